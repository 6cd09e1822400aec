"""Weight-only quantized linear layers.

Where pagoda's compiled CPU kernels load (the usual case), every mode stores ggml's blocks of 32
and multiplies them with ``torch.ops.pagoda.block_matmul`` (pagoda/layers/ggml_blocks.py):
``int8`` → Q8_0, ``int4`` → Q4_1, ``gguf`` → the file's Q4_0 / Q4_1 / Q8_0 blocks byte for byte,
and the output head (with a tied embedding) in Q8_0, or as the GGUF stores it. Where no compiler
is available, the layers run on torch's own CPU kernels instead (torch_int_linears.py).

Three modes (``--quantization``):

- ``int8``: symmetric per-output-channel int8 (torch's kernels: ``Int8Linear``, torch_int_linears.py).
- ``int4``: asymmetric group-wise int4 in groups of 32 (torch's kernels: ``Int4Linear``).
- ``gguf``: a GGUF's weights kept as they are stored (stored_weights.py): blocks for pagoda's
  kernels; on torch's, Q4_0 / Q4_1 as ``Int4Linear`` groups, the codes copied, never re-quantized.

``quantize_linears`` replaces a built model's projections (and the output head) with those layers.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagoda.layers import ggml_blocks, half_weights, superblocks
from pagoda.layers.ggml_blocks import BlockEmbedding, BlockLinear
from pagoda.layers.half_weights import HalfEmbedding
from pagoda.layers.stored_weights import (
    PackedWeight,
    block_kernels_available,
    block_linear,
    int4_from_packed,
    stacked_blocks,
)
from pagoda.layers.superblocks import SuperBlockEmbedding
from pagoda.layers.torch_int_linears import COMPUTE_DTYPE, INT4_GROUP_SIZE, Int4Linear, Int8Embedding, Int8Linear

if TYPE_CHECKING:
    from pagoda.loader.repacked_cache import RepackCache

logger = logging.getLogger(__name__)

QUANTIZATION_MODES = ("int8", "int4", "gguf")
# The projections that get quantized; the embedding, lm_head and norms stay in the model dtype.
QUANTIZED_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# int8/int4 modes: also the output head (and a tied embedding). None: yes (Q8_0) with the block
# kernels, no with torch's kernels (their int8 head loses to the float one at batch 64).
QUANTIZE_LM_HEAD: bool | None = None


def check_quantization(mode: str | None) -> str | None:
    """Normalize a ``--quantization`` value: None / "none" → None; otherwise one of QUANTIZATION_MODES."""
    if mode is None or str(mode).lower() in ("none", ""):
        return None
    name = str(mode).lower()
    if name not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of none, {', '.join(QUANTIZATION_MODES)}; got {mode!r}")
    return name


def quantize_linears(model: nn.Module, mode: str, packed: dict[str, list[PackedWeight]] | None = None,
                     compute_dtype: torch.dtype | None = None, quantize_head: bool | None = None,
                     cache: RepackCache | None = None) -> int:
    """Replace the model's projection layers (``QUANTIZED_LINEARS``) with quantized ones, in place.

    ``int8``/``int4`` quantize the loaded float weights. ``gguf`` keeps the stored blocks in
    ``packed`` (weight name → its shards, as the loader handed them over); a layer without a kept
    form stays float. The output head: with the block kernels, ``gguf`` keeps it as stored (a tied
    embedding shares its blocks) and ``int8``/``int4`` make it Q8_0 unless ``quantize_head`` (default
    ``QUANTIZE_LM_HEAD``) is False; with torch's kernels it becomes int8 only if ``quantize_head``
    is True. ``compute_dtype`` (torch's kernels only) defaults to ``COMPUTE_DTYPE``. ``cache``
    keeps repacked super-block weights between starts (loader/repacked_cache.py).
    Returns how many layers were replaced.
    """
    mode = check_quantization(mode)
    replaced = quantize_projections(model, mode, packed, compute_dtype, cache)
    return replaced + quantize_output_head(model, mode, packed, compute_dtype, quantize_head, cache)


def quantize_projections(module: nn.Module, mode: str, packed: dict[str, list[PackedWeight]] | None = None,
                         compute_dtype: torch.dtype | None = None, cache: RepackCache | None = None,
                         prefix: str = "") -> int:
    """``quantize_linears``'s projections of ``module`` alone; ``prefix``: the module's name in its
    model (``layers.3.``, progressive loading quantizes one layer at a time), which names its
    weights in ``packed`` and in the repacked cache. Returns how many layers were replaced."""
    blocks = block_kernels_available()
    replaced, kept = 0, []
    for local, linear in list(module.named_modules()):
        if not isinstance(linear, nn.Linear) or local.rsplit(".", 1)[-1] not in QUANTIZED_LINEARS:
            continue
        name = prefix + local
        shards = (packed or {}).get(f"{name}.weight")
        new = (_block_layer(linear, mode, shards, cache, name) if blocks
               else _torch_kernel_layer(linear, mode, shards, compute_dtype or COMPUTE_DTYPE))
        if new is None:
            kept.append(name)
            continue
        module.set_submodule(local, new)
        replaced += 1
    if kept:  # one line a model, not one a layer
        (logger.debug if prefix else logger.info)(
            "quantization=%s: %d projections kept in float (no exact or supported packed form), e.g. %s",
            mode, len(kept), kept[:3])
    return replaced


def quantize_output_head(model: nn.Module, mode: str, packed: dict[str, list[PackedWeight]] | None = None,
                         compute_dtype: torch.dtype | None = None, quantize_head: bool | None = None,
                         cache: RepackCache | None = None) -> int:
    """``quantize_linears``'s embedding and output head of ``model`` (see there)."""
    head = QUANTIZE_LM_HEAD if quantize_head is None else quantize_head
    if block_kernels_available():
        return _block_head(model, mode, packed or {}, head is not False, cache)
    if head and mode in ("int8", "int4"):
        return _quantize_head(model, compute_dtype or COMPUTE_DTYPE)
    return 0


_FLOAT_BLOCK_TYPE = {"int8": ggml_blocks.Q8_0, "int4": ggml_blocks.Q4_1}


def _block_layer(module: nn.Linear, mode: str, shards: list[PackedWeight] | None, cache: RepackCache | None,
                 name: str) -> nn.Module | None:
    if mode == "gguf":
        return block_linear(*stacked_blocks(shards, cache, name), module.in_features, module.bias) if shards else None
    if module.in_features % ggml_blocks.BLOCK:
        return None
    return BlockLinear.from_float(module.weight, _FLOAT_BLOCK_TYPE[mode], module.bias)


def _torch_kernel_layer(module: nn.Linear, mode: str, shards: list[PackedWeight] | None,
                        compute_dtype: torch.dtype) -> nn.Module | None:
    if mode == "gguf":
        return int4_from_packed(shards, module.bias, compute_dtype) if shards else None
    if mode == "int8":
        return Int8Linear.from_float(module.weight, module.bias, compute_dtype)
    if Int4Linear.supports(module.out_features, module.in_features):
        return Int4Linear.from_float(module.weight, module.bias, INT4_GROUP_SIZE, compute_dtype)
    return None


def _block_head(model: nn.Module, mode: str, packed: dict[str, list[PackedWeight]], quantize_floats: bool,
                cache: RepackCache | None = None) -> int:
    """The embedding and output head as blocks: a GGUF's stored ones under ``gguf``, Q8_0 from the
    float weights under ``int8``/``int4``. A tied head shares the embedding's blocks."""
    embed, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    if not isinstance(embed, nn.Embedding) or not (head is None or isinstance(head, nn.Linear)):
        return 0
    dim, dtype = embed.embedding_dim, embed.weight.dtype
    if mode == "gguf":
        embed_blocks = (stacked_blocks(packed["embed_tokens.weight"], cache, "embed_tokens")
                        if "embed_tokens.weight" in packed else None)
        head_blocks = stacked_blocks(packed["lm_head.weight"], cache, "lm_head") if "lm_head.weight" in packed else None
    elif quantize_floats and dim % ggml_blocks.BLOCK == 0:
        embed_blocks = (ggml_blocks.quantize_q8_0(embed.weight), ggml_blocks.Q8_0) if head is None else None
        head_blocks = None if head is None else (ggml_blocks.quantize_q8_0(head.weight), ggml_blocks.Q8_0)
    else:
        return 0
    replaced = 0
    if embed_blocks is not None:
        blocks, block_type = embed_blocks
        model.embed_tokens = (SuperBlockEmbedding(blocks, dtype) if block_type == superblocks.PACKED
                              else HalfEmbedding(blocks, dtype) if block_type == half_weights.PACKED
                              else BlockEmbedding(blocks, block_type, dim, dtype))
        if head is None:
            model.lm_head = block_linear(blocks, block_type, dim)
        replaced += 1
    if head is not None and head_blocks is not None:
        blocks, block_type = head_blocks
        model.lm_head = block_linear(blocks, block_type, head.in_features, head.bias)
        replaced += 1
    return replaced


def _quantize_head(model: nn.Module, compute_dtype: torch.dtype) -> int:
    """int8 output head (``model.lm_head``, or the tied ``model.embed_tokens`` table)."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear):
        model.lm_head = Int8Linear.from_float(head.weight, head.bias, compute_dtype)
        return 1
    embed = getattr(model, "embed_tokens", None)
    if head is not None or not isinstance(embed, nn.Embedding):
        return 0
    model.lm_head = Int8Linear.from_float(embed.weight, None, compute_dtype)
    model.embed_tokens = Int8Embedding(model.lm_head.qweight, model.lm_head.scales, embed.weight.dtype)
    return 1


def weight_bytes(model: nn.Module) -> int:
    """Bytes held by the model's parameters and buffers (each tensor counted once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = (t.data_ptr(), t.nbytes)
        if key not in seen:
            seen.add(key)
            total += t.nbytes
    return total


def is_auto(value) -> bool:
    return value is None or str(value).lower() == "auto"


def pooling_quantization(quantization: str | None, encoder: bool) -> str | None:
    """The pooling runner's weights: float unless a mode is named (auto: none, so embeddings match
    the reference's); an encoder's layers have no quantized form."""
    if is_auto(quantization) or str(quantization).lower() == "none":
        return None
    if encoder:
        raise ValueError(f"quantization={quantization!r}: an encoder's layers (BERT) run in float only")
    return check_quantization(quantization)
