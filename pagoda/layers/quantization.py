"""Weight-only quantized linear layers.

Where pagoda's compiled CPU kernels load (the usual case), every mode stores ggml's blocks of 32
and multiplies them with ``torch.ops.pagoda.block_matmul`` (pagoda/layers/ggml_blocks.py):
``int8`` → Q8_0, ``int4`` → Q4_1, ``gguf`` → the file's Q4_0 / Q4_1 / Q8_0 blocks byte for byte,
and the output head (with a tied embedding) in Q8_0, or as the GGUF stores it. The rest of this
module is the fallback on torch's own CPU kernels, used when no compiler is available:

Three modes (``--quantization``):

- ``int8``: symmetric per-output-channel int8, ``w = q * scale``, q in [-128, 127]; the matmul is
  ``aten._weight_int8pack_mm``.
- ``int4``: asymmetric group-wise int4 (groups of ``INT4_GROUP_SIZE`` along the input dimension),
  ``w = (q - 8) * scale + zero``, q in [0, 15]; the weight is packed by
  ``aten._convert_weight_to_int4pack_for_cpu`` and the matmul is ``aten._weight_int4pack_mm_for_cpu``.
- ``gguf``: a GGUF's Q4_0 / Q4_1 weights kept as they are stored. Both are int4 in groups of 32,
  ``Q4_0: w = d * (q - 8)`` and ``Q4_1: w = d * q + m``, so they map onto the int4 kernel's layout
  with ``scale = d`` and ``zero = 0`` (Q4_0) or ``zero = m + 8 d`` (Q4_1): the codes are copied, never
  re-quantized.

The kernels' activation dtype (``compute_dtype``) is bf16: on this kind of CPU (AVX2, no AMX) their
fp32 and fp16 paths run 10-60x slower than an fp32 ``nn.Linear``, while the bf16 path beats it at
batch 1 (benchmarks/README.md). A layer therefore casts its input to bf16 and its output back to the
model's dtype; the scales live in bf16 too, as the kernels require. With ``compute_dtype=float32``
the same layers compute exactly with the stored values (slowly), which is how the tests check that
a repacked GGUF weight is the dequantized weight bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagoda.layers import ggml_blocks, half_weights, superblocks
from pagoda.layers.backend import current_backend
from pagoda.layers.ggml_blocks import BlockEmbedding, BlockLinear
from pagoda.layers.half_weights import HalfEmbedding, HalfLinear
from pagoda.layers.superblocks import SuperBlockEmbedding, SuperBlockLinear

if TYPE_CHECKING:
    from pagoda.loader.repacked_cache import RepackCache

logger = logging.getLogger(__name__)

QUANTIZATION_MODES = ("int8", "int4", "gguf")
INT4_GROUP_SIZE = 32
COMPUTE_DTYPE = torch.bfloat16  # the kernels' only fast activation dtype on CPU
# The projections that get quantized; the embedding, lm_head and norms stay in the model dtype.
QUANTIZED_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# int8/int4 modes: also the output head (and a tied embedding). None: yes (Q8_0) with the block
# kernels, no with torch's kernels (their int8 head loses to the float one at batch 64).
QUANTIZE_LM_HEAD: bool | None = None


class PackedWeight:
    """A weight handed over by a loader in a stored quantized form (e.g. GGUF blocks).

    Where ``int4_exact`` is true, ``int4_groups`` gives that form exactly as int4 codes with a scale
    and zero per group of ``INT4_GROUP_SIZE`` (``w = (q - 8) * scale + zero``); ``dequantize`` gives
    the float32 weight in every case.
    """

    shape: tuple[int, ...]
    int4_exact: bool = False

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError

    ggml_block_type: int | None = None  # one of ggml_blocks' types when the stored form is one

    def ggml_blocks(self) -> torch.Tensor:
        """The stored blocks, uint8 [rows, bytes per row] (only where ``ggml_block_type`` is set)."""
        raise ValueError(f"{type(self).__name__} holds no ggml blocks")

    def int4_groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise ValueError(f"{type(self).__name__} has no exact int4 form")

    def rows(self, start: int, stop: int) -> PackedWeight:
        """Output rows ``start:stop`` in the same stored form (a fused checkpoint tensor's parts)."""
        raise ValueError(f"{type(self).__name__} cannot be cut into rows")


def _matmul_input(x: torch.Tensor, in_features: int, compute_dtype: torch.dtype) -> torch.Tensor:
    return x.reshape(-1, in_features).to(compute_dtype)


def _finish(y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = y.to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


class Int8Linear(nn.Module):
    """``y = x @ (q * scale).T + bias`` with ``aten._weight_int8pack_mm``."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("bias", bias)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.scales.dtype

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   compute_dtype: torch.dtype = COMPUTE_DTYPE) -> Int8Linear:
        w = weight.detach().float()
        # Round the scale to the kernel's dtype first, then the codes against it: the layer
        # computes with exactly q * scale, no second rounding of the scale.
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8).to(compute_dtype)
        q = torch.round(w / scales.float()[:, None]).clamp_(-128, 127).to(torch.int8)
        return cls(q, scales, None if bias is None else bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(_matmul_input(x, self.in_features, self.compute_dtype),
                                               self.qweight, self.scales)
        return _finish(y, x, self.bias)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight this layer multiplies by."""
        return self.qweight.float() * self.scales.float()[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel, {self.compute_dtype}"


class Int8Embedding(nn.Module):
    """An embedding table stored as int8 rows with one scale per row (the layout of an Int8Linear
    over the same table, so a tied output head shares the tensors)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = qweight.shape
        self.dtype = dtype
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight[ids].to(self.dtype) * self.scales[ids].to(self.dtype).unsqueeze(-1)


class Int4Linear(nn.Module):
    """``y = x @ W.T + bias`` with W int4 in groups: ``w = (q - 8) * scale + zero``,
    via ``aten._weight_int4pack_mm_for_cpu``."""

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features = packed.shape[0]
        self.in_features = packed.shape[1] * 2
        self.group_size = group_size
        self.register_buffer("qweight", packed)  # uint8 [N, K/2], the kernel's own layout
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # [K/G, N, 2]
        self.register_buffer("bias", bias)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.scales_and_zeros.dtype

    @staticmethod
    def supports(out_features: int, in_features: int, group_size: int = INT4_GROUP_SIZE) -> bool:
        """Shapes the CPU packing accepts: N a multiple of 16, K of the group size."""
        return out_features % 16 == 0 and in_features % group_size == 0

    @classmethod
    def from_groups(cls, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    bias: torch.Tensor | None = None, group_size: int = INT4_GROUP_SIZE,
                    compute_dtype: torch.dtype = COMPUTE_DTYPE) -> Int4Linear:
        """From codes [N, K] in 0..15 and scale, zero [N, K/G] (``w = (q - 8) * scale + zero``)."""
        n, k = codes.shape
        if not cls.supports(n, k, group_size):
            raise ValueError(f"int4 packing needs out_features % 16 == 0 and in_features % {group_size} == 0, "
                             f"got {n} x {k}")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).to(compute_dtype).contiguous()
        return cls(packed, scales_and_zeros, group_size, None if bias is None else bias.detach())

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, group_size: int = INT4_GROUP_SIZE,
                   compute_dtype: torch.dtype = COMPUTE_DTYPE) -> Int4Linear:
        """Min/max asymmetric quantization per group of ``group_size`` inputs."""
        w = weight.detach().float()
        n, k = w.shape
        groups = w.reshape(n, k // group_size, group_size)
        lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
        # As for int8: scale and zero in the kernel's dtype first, the codes against those values.
        scale = ((hi - lo) / 15.0).clamp(min=1e-8).to(compute_dtype).float()
        zero = (lo + 8.0 * scale).to(compute_dtype).float()
        codes = torch.round((groups - zero[..., None]) / scale[..., None] + 8.0).clamp_(0, 15)
        return cls.from_groups(codes.reshape(n, k), scale, zero, bias, group_size, compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(_matmul_input(x, self.in_features, self.compute_dtype),
                                                       self.qweight, self.group_size, self.scales_and_zeros)
        return _finish(y, x, self.bias)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight this layer multiplies by: the kernel itself, in fp32, applied to the
        identity (exact: each output is one product ``1 * w`` plus zeros)."""
        eye = torch.eye(self.in_features, dtype=torch.float32)
        sz = self.scales_and_zeros.float()
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.qweight, self.group_size, sz).T.contiguous()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int4 groups of {self.group_size}, {self.compute_dtype}")


def block_kernels_available() -> bool:
    """Whether quantized layers use the block kernels (else torch's int8/int4 kernels): the
    backend of the model being built has pagoda's C++ kernels."""
    return current_backend().has_cpu_kernels


def _block_type(shards: Sequence[PackedWeight]) -> int | None:
    """The one block type ``shards`` stack into: Q4_0, Q4_1 or Q8_0 alone as they are (Q4_0 joins
    Q4_1 as Q4_1); any other mix of the types superblocks.py holds, one ``superblocks.PACKED``
    weight; else None."""
    types = {s.ggml_block_type for s in shards}
    if not shards or None in types or len({s.shape[1] for s in shards}) != 1:
        return None
    if len(types) == 1 and types <= half_weights.HALF_TYPES:
        return half_weights.PACKED
    if len(types) == 1 and types <= superblocks.BLOCK32_TYPES:
        return types.pop()
    if types <= {ggml_blocks.Q4_0, ggml_blocks.Q4_1}:
        return ggml_blocks.Q4_1
    return superblocks.PACKED if types <= superblocks.SUPERBLOCK_TYPES else None


def stacked_blocks(shards: Sequence[PackedWeight], cache: RepackCache | None = None,
                   name: str = "") -> tuple[torch.Tensor, int]:
    """``shards`` stacked along the output dimension as one (blocks, block type); super-block
    formats and F16 / BF16 as one packed weight (superblocks.repack, half_weights.repack; with
    ``cache``, as packed at an earlier start, under ``name``)."""
    block_type = _block_type(shards)
    if block_type is None:
        raise ValueError("these weights have no common ggml block form")
    if block_type == superblocks.PACKED:
        parts = [(s.ggml_blocks, s.ggml_block_type, s.shape[0]) for s in shards]
        return superblocks.repack(parts, shards[0].shape[1], cache, name), block_type
    if block_type == half_weights.PACKED:
        rows = sum(s.shape[0] for s in shards)
        packed = half_weights.repack(lambda: torch.cat([s.ggml_blocks() for s in shards]), shards[0].ggml_block_type,
                                     (rows, shards[0].shape[1]), cache, name)
        return packed, block_type
    parts = [s.ggml_blocks() if s.ggml_block_type == block_type else ggml_blocks.q4_0_to_q4_1(s.ggml_blocks())
             for s in shards]
    return torch.cat(parts), block_type


def block_linear(blocks: torch.Tensor, block_type: int, in_features: int,
                 bias: torch.Tensor | None = None) -> BlockLinear | SuperBlockLinear | HalfLinear:
    """The layer for stacked blocks of ``block_type`` (``stacked_blocks``' result)."""
    if block_type == superblocks.PACKED:
        return SuperBlockLinear(blocks, bias)
    if block_type == half_weights.PACKED:
        return HalfLinear(blocks, bias)
    return BlockLinear(blocks, block_type, in_features, bias)


def keeps_packed(shards: Sequence[PackedWeight], projection: bool = True) -> bool:
    """Whether a loader's stored shards of one weight can stay quantized: as blocks with the block
    kernels; otherwise, for projections only, as torch's int4 groups."""
    if block_kernels_available():
        return _block_type(shards) is not None
    return projection and can_pack(shards)


def can_pack(shards: Sequence[PackedWeight]) -> bool:
    """Whether ``shards`` (stacked along the output dimension, as merged QKV and gate/up are) have
    an exact int4 form the CPU packing accepts."""
    if not shards or not all(s.int4_exact for s in shards):
        return False
    in_features = {s.shape[1] for s in shards}
    return len(in_features) == 1 and Int4Linear.supports(sum(s.shape[0] for s in shards), in_features.pop())


def int4_from_packed(shards: Sequence[PackedWeight], bias: torch.Tensor | None = None,
                     compute_dtype: torch.dtype = COMPUTE_DTYPE) -> Int4Linear:
    """An Int4Linear holding ``shards`` (stacked along the output dimension) exactly as stored."""
    if not can_pack(shards):
        raise ValueError("these weights have no exact int4 form that packs")
    codes, scale, zero = (torch.cat(parts, dim=0) for parts in zip(*(s.int4_groups() for s in shards)))
    return Int4Linear.from_groups(codes, scale, zero, bias, INT4_GROUP_SIZE, compute_dtype)


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
    blocks = block_kernels_available()
    replaced, kept = 0, []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or name.rsplit(".", 1)[-1] not in QUANTIZED_LINEARS:
            continue
        shards = (packed or {}).get(f"{name}.weight")
        new = (_block_layer(module, mode, shards, cache, name) if blocks
               else _torch_kernel_layer(module, mode, shards, compute_dtype or COMPUTE_DTYPE))
        if new is None:
            kept.append(name)
            continue
        model.set_submodule(name, new)
        replaced += 1
    if kept:
        logger.info("quantization=%s: %d projections kept in float (no exact or supported packed form), e.g. %s",
                    mode, len(kept), kept[:3])
    head = QUANTIZE_LM_HEAD if quantize_head is None else quantize_head
    if blocks:
        replaced += _block_head(model, mode, packed or {}, head is not False, cache)
    elif head and mode in ("int8", "int4"):
        replaced += _quantize_head(model, compute_dtype or COMPUTE_DTYPE)
    return replaced


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
