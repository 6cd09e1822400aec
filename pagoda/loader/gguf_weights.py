"""A GGUF's tensors → Hugging-Face-named weights (``iter_gguf_weights``).

Yields ``(hf_name, float32 tensor)`` for every weight, undoing llama.cpp's storage conventions:
its tensor names, Q/K row permutation (``llama`` only), ``1 + w`` norms (``gemma3``), stacked
experts, and the reversed dimension order of GGUF shapes. Every tensor is mapped and checked
against the config before any is dequantized. With ``keep_quantized`` (``--quantization gguf``),
weights of a kept type come as ``GGUFPackedWeight`` (the stored blocks, gguf_packed_weight.py)
instead; with ``narrow`` (tensor parallelism), only a rank's slice is read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from pagoda.loader.gguf_config import check_architecture, hf_architecture
from pagoda.loader.gguf_file import _PLAIN_DTYPES, GGUFFile, GGUFTensorInfo, _check_dequantizable, read_gguf
from pagoda.loader.gguf_packed_weight import KEPT_QUANTIZED_TYPES, GGUFPackedWeight

logger = logging.getLogger(__name__)


_TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 norms around both sublayers: llama.cpp's ffn_norm is the pre-FFN one there.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Mixture of experts (Qwen-MoE / OLMoE checkpoint names); ``*`` is the expert: llama.cpp stacks
# the experts of a layer into one tensor [experts, rows, columns].
_MOE_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.*.gate_proj",
    "ffn_up_exps": "mlp.experts.*.up_proj",
    "ffn_down_exps": "mlp.experts.*.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Mixtral's checkpoint names: block_sparse_moe, w1 (gate), w3 (up), w2 (down)
_MIXTRAL_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_gate_inp": "block_sparse_moe.gate",
    "ffn_gate_exps": "block_sparse_moe.experts.*.w1",
    "ffn_up_exps": "block_sparse_moe.experts.*.w3",
    "ffn_down_exps": "block_sparse_moe.experts.*.w2",
}
# Phi-3 keeps q/k/v and gate/up fused; llama.cpp's ffn_up is the fused gate/up.
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Tensors that only feed the config (llama3 rope factors are folded into rope_scaling, Phi-3's
# LongRoPE factors into its rope_parameters).
_CONFIG_ONLY_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def _layer_names(arch: str, model_type: str | None) -> dict[str, str]:
    if arch == "gemma3":
        return _GEMMA3_LAYER_NAMES
    if arch == "phi3":
        return _PHI3_LAYER_NAMES
    if model_type == "mixtral":
        return _MIXTRAL_LAYER_NAMES
    return _MOE_LAYER_NAMES if arch in ("qwen2moe", "qwen3moe", "olmoe") else _LAYER_NAMES


def gguf_to_hf_name(name: str, arch: str, model_type: str | None = None) -> str | None:
    """The HF parameter name for a GGUF tensor name, or None if it has none. A stacked experts
    tensor's name has ``*`` for the expert (``model.layers.0.mlp.experts.*.up_proj.weight``);
    ``model_type`` tells Mixtral (written as "llama") apart."""
    stem, dot, suffix = name.rpartition(".")
    if not dot or suffix not in ("weight", "bias"):
        return None
    if stem in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    hf = _layer_names(arch, model_type).get(parts[2])
    return f"model.layers.{parts[1]}.{hf}.{suffix}" if hf else None


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's q/k permutation.

    llama.cpp's converter stores ``w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2)``
    so that each head's rotary pairs are adjacent (GPT-J style) rather than split in halves (HF's
    rotate_half). Swapping the same axes back restores HF's row order.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _expected_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF shape per parameter-name suffix (after ``model.layers.N.``), for shape checks."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    vocab = config["vocab_size"]
    q, kv = heads * head_dim, kv_heads * head_dim
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    expert_inter = config.get("moe_intermediate_size") or inter
    shared = config.get("shared_expert_intermediate_size") or 0
    norm = (q, kv) if config.get("model_type") == "olmoe" else (head_dim, head_dim)  # OLMoE: the whole projection
    moe = {  # stacked experts as stored: [experts, rows, columns]
        f"{block}.experts.*.{name}.weight": (experts, *shape)
        for block, names in (("mlp", ("gate_proj", "up_proj", "down_proj")), ("block_sparse_moe", ("w1", "w3", "w2")))
        for name, shape in zip(names, ((expert_inter, hidden), (expert_inter, hidden), (hidden, expert_inter)))
    }
    return {
        **moe, "mlp.gate.weight": (experts, hidden), "block_sparse_moe.gate.weight": (experts, hidden),
        "mlp.shared_expert.gate_proj.weight": (shared, hidden), "mlp.shared_expert.up_proj.weight": (shared, hidden),
        "mlp.shared_expert.down_proj.weight": (hidden, shared), "mlp.shared_expert_gate.weight": (hidden,),
        "self_attn.qkv_proj.weight": (q + 2 * kv, hidden), "mlp.gate_up_proj.weight": (2 * inter, hidden),
        "model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden), "model.norm.weight": (hidden,),
        "self_attn.q_proj.weight": (q, hidden), "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, q),
        "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
        "self_attn.q_norm.weight": norm[:1], "self_attn.k_norm.weight": norm[1:],
        "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
        "pre_feedforward_layernorm.weight": (hidden,), "post_feedforward_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }


def _shape_key(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        return hf_name.split(".", 3)[3]
    return hf_name


def _plan_weights(gf: GGUFFile, config: Mapping[str, Any]) -> list[tuple[GGUFTensorInfo, str]]:
    """Map and check every tensor before any is dequantized, so a bad file fails fast."""
    arch = gf.architecture
    expected = _expected_shapes(config)
    n_layers = config["num_hidden_layers"]
    plan = []
    for info in gf.tensors.values():
        if info.name in _CONFIG_ONLY_TENSORS:
            continue
        hf_name = gguf_to_hf_name(info.name, arch, config.get("model_type"))
        if hf_name is None:
            logger.warning("%s: skipping tensor %r (no Hugging Face counterpart)", gf.path, info.name)
            continue
        if hf_name.startswith("model.layers.") and int(hf_name.split(".")[2]) >= n_layers:
            raise ValueError(f"{gf.path}: tensor {info.name!r} is beyond num_hidden_layers={n_layers}")
        want = expected.get(_shape_key(hf_name))
        if want is not None and info.shape != want:
            raise ValueError(f"{gf.path}: tensor {info.name!r} has shape {list(info.shape)}, but the config "
                             f"implies {list(want)} for {hf_name}")
        _check_dequantizable(info)
        plan.append((info, hf_name))
    return plan


def _check_config_matches(gf: GGUFFile, config: Mapping[str, Any]) -> None:
    model_type = config.get("model_type")
    expected = hf_architecture(gf)[1]
    if model_type is not None and model_type != expected:
        raise ValueError(f"{gf.path}: the GGUF is {gf.architecture!r} (HF model_type {expected!r}), but the "
                         f"config says model_type {model_type!r}")


def iter_gguf_weights(gguf_path: Path | GGUFFile, config: Mapping[str, Any], *, keep_quantized: bool = False,
                      narrow: WeightSlicer | None = None,
                      only: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor | GGUFPackedWeight]]:
    """Yield ``(hf_parameter_name, float32 tensor in HF shape)`` for every weight in the GGUF.

    ``config`` is the HF config dict (as ``convert_gguf_metadata`` writes it); head counts come from
    it. With ``keep_quantized``, 2-D weights of a ``KEPT_QUANTIZED_TYPES`` type come as a
    ``GGUFPackedWeight`` (the stored blocks, rows un-permuted like the float path) instead.
    Raises ValueError, before yielding anything, for an invalid/truncated file, an unsupported
    architecture, a tensor type pagoda cannot dequantize, or a shape that disagrees with the config.

    ``narrow`` (tensor parallelism) gives, per HF name and shape, the slice this rank holds: only
    that part is read and dequantized, and a kept-quantized weight is cut along whole blocks.
    ``only`` (progressive loading): the HF names to yield, the others not read; ``gguf_path`` may
    then be the file already read, so that its metadata is parsed once for every layer.
    """
    gf = gguf_path if isinstance(gguf_path, GGUFFile) else read_gguf(gguf_path)
    arch = check_architecture(gf)
    _check_config_matches(gf, config)
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    for stacked, stacked_name in _plan_weights(gf, config):
        if only is not None and not only(stacked_name):
            continue
        for info, hf_name in _unstacked(stacked, stacked_name):
            packed = keep_quantized and info.ggml_type in KEPT_QUANTIZED_TYPES and len(info.shape) == 2
            cut = narrow(hf_name, info.shape) if narrow is not None else None
            w, shape = _read_slice(gf, info, cut, dequantize_it=not packed)
            # Row permutations act on whole rows (within a head), so they apply to stored blocks as
            # to floats, and to a slice of whole heads with the slice's head count.
            if arch == "llama" and ".self_attn.q_proj." in hf_name:
                w = unpermute_rows(w, heads * shape[0] // info.shape[0])
            elif arch == "llama" and ".self_attn.k_proj." in hf_name:
                w = unpermute_rows(w, kv_heads * shape[0] // info.shape[0])
            elif arch == "gemma3" and hf_name.endswith("norm.weight"):
                # llama.cpp's converter stores Gemma's RMSNorm weight as (1 + w); HF keeps w.
                w = w - 1.0
            if packed:
                yield hf_name, GGUFPackedWeight(info.ggml_type, w, shape)
                continue
            w = np.ascontiguousarray(w, dtype=np.float32)
            if not w.flags.writeable:  # a view of the read-only mapping (F32 tensors)
                w = w.copy()
            if hf_name.endswith(".shared_expert_gate.weight"):
                w = w.reshape(1, -1)  # llama.cpp stores the [1, hidden] gate as [hidden]
            yield hf_name, torch.from_numpy(w)


def _unstacked(info: GGUFTensorInfo, hf_name: str) -> Iterator[tuple[GGUFTensorInfo, str]]:
    """A tensor of stacked experts (``*`` in its name) → one 2-D tensor per expert (where it lies
    in the file); any other tensor as it is."""
    if "*" not in hf_name:
        yield info, hf_name
        return
    experts = info.shape[0]
    size = info.nbytes // experts
    for e in range(experts):
        yield (GGUFTensorInfo(f"{info.name}[{e}]", info.ggml_type, info.shape[1:], info.offset + e * size, size),
               hf_name.replace("*", str(e)))


# (HF name, full shape) → (dim, start, length) of the part to read, or None for all of it
WeightSlicer = Callable[[str, tuple[int, ...]], "tuple[int, int, int] | None"]


def _read_slice(gf: GGUFFile, info: GGUFTensorInfo, cut: tuple[int, int, int] | None,
                dequantize_it: bool) -> tuple[np.ndarray, tuple[int, ...]]:
    """The tensor's ``cut`` (all of it for None): stored blocks, or float32 when ``dequantize_it``.
    A cut along the last dimension of a block type must fall on block boundaries."""
    shape = list(info.shape)
    data = gf.stored_array(info)
    if cut is not None:
        dim, start, length = cut
        dim %= len(shape)
        index = [slice(None)] * data.ndim
        if dim == len(shape) - 1 and info.ggml_type not in _PLAIN_DTYPES:
            block, type_size = GGML_QUANT_SIZES[info.ggml_type]
            if start % block or length % block:
                raise ValueError(f"{gf.path}: tensor {info.name!r} ({info.ggml_type.name}) cannot be split at "
                                 f"column {start}..{start + length}: not a multiple of its {block}-element blocks")
            index[dim] = slice(start // block * type_size, (start + length) // block * type_size)
        else:
            index[dim] = slice(start, start + length)
        data = data[tuple(index)]
        shape[dim] = length
    if not dequantize_it:
        return data, tuple(shape)
    _check_dequantizable(info)
    if info.ggml_type == GGMLQuantizationType.F64:
        return data.astype(np.float32), tuple(shape)
    return np.asarray(dequantize(np.ascontiguousarray(data), info.ggml_type), dtype=np.float32).reshape(shape), tuple(shape)
