"""The tensors of a GGUF pagoda writes (gguf_writer.py): llama.cpp's names for Hugging Face
parameters, the ``llama`` architecture's Q/K rows permuted to its interleaved rotary order,
Gemma 3's norms as ``1 + w``, a layer's experts stacked into one tensor per projection, 2-D
weights in the file's type (``quantize_weight``; a ``BlockTensor`` already in ggml blocks as it
is), norms, biases and routers in F32, and Phi-3's LongRoPE factors.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagoda.models.config import rope_scaling

# Types gguf.quants can *write*. The K-quants it can only read.
WRITABLE_QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")

_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# Gemma 3 norms around both sublayers: llama.cpp's ffn_norm is the pre-FFN one there.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_MOE_LAYER_NAMES = {
    **_LAYER_NAMES,
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "block_sparse_moe.gate": "ffn_gate_inp",  # Mixtral's
}
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
# an expert's projection (Qwen / OLMoE names, Mixtral's) → the stacked tensor it joins
_EXPERT_TENSORS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                   "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
_EXPERT_NAME = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_F32_LAYER_TENSORS = ("ffn_gate_inp", "ffn_gate_inp_shexp")  # routers: llama.cpp keeps them F32
_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


@dataclass(frozen=True)
class BlockTensor:
    """A 2-D weight already in ggml blocks (``pagoda quantize``): ``blocks`` uint8 [rows, bytes per
    row] of ``qtype`` (Q4_0, Q4_1 or Q8_0), rows in the Hugging Face order, written as they are."""

    blocks: np.ndarray
    qtype: str


def gguf_tensor_name(hf_name: str, arch: str = "llama") -> str:
    """llama.cpp's name for an HF parameter (``model.layers.3.mlp.up_proj.weight`` → ``blk.3.ffn_up.weight``)."""
    stem, _, suffix = hf_name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    names = {"gemma3": _GEMMA3_LAYER_NAMES, "phi3": _PHI3_LAYER_NAMES}.get(arch, _MOE_LAYER_NAMES)
    parts = stem.split(".", 3)
    if len(parts) != 4 or parts[:2] != ["model", "layers"] or parts[3] not in names:
        raise ValueError(f"cannot write {hf_name!r} to GGUF: not a tensor of the {arch} layout")
    return f"blk.{parts[2]}.{names[parts[3]]}.{suffix}"


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (HF rotate-half row order → interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _permute_rows(w: np.ndarray | BlockTensor, n_head: int) -> np.ndarray | BlockTensor:
    """``permute_qk`` of a float weight or of a quantized one's rows (blocks run along a row)."""
    if isinstance(w, BlockTensor):
        return BlockTensor(permute_qk(w.blocks, n_head), w.qtype)
    return permute_qk(w, n_head)


def quantize_weight(w: np.ndarray, qtype: str) -> np.ndarray:
    """``w`` in the storage form GGUFWriter takes for ``qtype`` (ValueError where gguf cannot)."""
    import gguf  # deferred: gguf loads on first use

    if qtype not in WRITABLE_QTYPES:
        raise ValueError(f"cannot write {qtype}: gguf can write {', '.join(WRITABLE_QTYPES)}")
    block_size, _ = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    if w.shape[-1] % block_size:
        raise ValueError(f"cannot write {qtype}: row length {w.shape[-1]} is not a multiple of {block_size}")
    return gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), gguf.GGMLQuantizationType[qtype])


def _phi3_rope_factors(config: dict) -> Iterator[tuple[str, np.ndarray]]:
    scaling = rope_scaling(config)
    for kind in ("short", "long") if scaling is not None else ():
        yield f"rope_factors_{kind}.weight", np.asarray(scaling[f"{kind}_factor"], dtype=np.float32)


def _hf_tensors(hf_dir: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor of the directory's safetensors files (sharded or not), as float32."""
    import torch  # torch loads on first use
    from safetensors import safe_open  # deferred: safetensors loads on first use

    from pagoda.loader.safetensors import safetensors_files  # deferred: loads torch

    for path in safetensors_files(hf_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name).to(torch.float32).numpy()


def add_tensors(writer, hf_dir: Path, config: dict, arch: str, qtype: str,
                 tensors: Iterable[tuple[str, np.ndarray | BlockTensor]] | None = None) -> None:
    n_head = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_head
    experts = _ExpertStacks(config)
    for hf_name, w in (_hf_tensors(hf_dir) if tensors is None else tensors):
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue  # computed, not learned
        if config.get("tie_word_embeddings") and hf_name == "lm_head.weight":
            continue  # llama.cpp omits output.weight when the head is the embedding
        if experts.holds(hf_name):  # kept until its layer's every expert is read, then stacked
            stacked = experts.add(hf_name, w)
            if stacked is not None:
                _add_weight(writer, *stacked, qtype)
            continue
        if arch == "llama" and ".self_attn.q_proj." in hf_name:
            w = _permute_rows(w, n_head)
        elif arch == "llama" and ".self_attn.k_proj." in hf_name:
            w = _permute_rows(w, n_kv)
        elif arch == "gemma3" and hf_name.endswith("norm.weight"):
            w = w + np.float32(1.0)  # llama.cpp stores Gemma's RMSNorm weight as (1 + w)
        name = gguf_tensor_name(hf_name, arch)
        if name.rsplit(".", 2)[-2] in _F32_LAYER_TENSORS and not isinstance(w, BlockTensor):
            # routers stay F32; the shared expert's gate [1, hidden] is stored as [hidden]
            writer.add_tensor(name, np.ascontiguousarray(w.reshape(-1) if "_shexp" in name else w, dtype=np.float32))
            continue
        _add_weight(writer, name, w, qtype)
    experts.check_complete()
    if arch == "phi3":
        for name, factors in _phi3_rope_factors(config):
            writer.add_tensor(name, factors)


def _add_weight(writer, name: str, w: np.ndarray | BlockTensor, qtype: str) -> None:
    """A weight in ``qtype`` (2-D ones and stacked experts' 3-D ones; norms and biases stay F32)."""
    import gguf  # deferred: gguf loads on first use

    if isinstance(w, BlockTensor):
        writer.add_tensor(name, np.ascontiguousarray(w.blocks), raw_dtype=gguf.GGMLQuantizationType[w.qtype])
    elif w.ndim < 2 or qtype == "F32":
        writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    elif qtype == "F16":
        writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float16))
    else:
        stored = quantize_weight(w, qtype)
        raw = gguf.GGMLQuantizationType[qtype]
        writer.add_tensor(name, stored, raw_dtype=raw if stored.dtype == np.uint8 else None)


class _ExpertStacks:
    """Each layer's per-expert tensors, collected into llama.cpp's stacked [experts, rows, columns]
    tensors (a ``BlockTensor``'s blocks stack the same way)."""

    def __init__(self, config: dict) -> None:
        self.count = int(config.get("num_experts") or config.get("num_local_experts") or 0)
        self.pending: dict[str, dict[int, np.ndarray | BlockTensor]] = {}  # GGUF name → expert → weight

    def holds(self, hf_name: str) -> bool:
        return self.count > 0 and _EXPERT_NAME.fullmatch(hf_name) is not None

    def add(self, hf_name: str, w: np.ndarray | BlockTensor) -> tuple[str, np.ndarray | BlockTensor] | None:
        """(GGUF name, stacked weight) once ``hf_name``'s layer has every expert of it, else None."""
        layer, expert, projection = _EXPERT_NAME.fullmatch(hf_name).groups()
        name = f"blk.{layer}.{_EXPERT_TENSORS[projection]}.weight"
        stack = self.pending.setdefault(name, {})
        stack[int(expert)] = w
        if len(stack) < self.count:
            return None
        done = self.pending.pop(name)
        parts = [done[i] for i in range(self.count)]
        if all(isinstance(p, BlockTensor) for p in parts) and len({p.qtype for p in parts}) == 1:
            return name, BlockTensor(np.stack([p.blocks for p in parts]), parts[0].qtype)
        return name, np.stack([p if isinstance(p, np.ndarray) else _dequantized(p) for p in parts])

    def check_complete(self) -> None:
        for name, stack in self.pending.items():
            raise ValueError(f"cannot write this model to GGUF: {name} has {len(stack)} of {self.count} experts")


def _dequantized(w: BlockTensor) -> np.ndarray:
    import gguf  # deferred: gguf loads on first use

    return gguf.quants.dequantize(w.blocks, gguf.GGMLQuantizationType[w.qtype])
