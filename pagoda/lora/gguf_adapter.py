"""Reading a LoRA adapter in GGUF, as llama.cpp's ``convert_lora_to_gguf.py`` writes it (what
Ollama's ``ADAPTER`` line and llama-server's ``--lora`` take): ``general.type`` "adapter",
``adapter.type`` "lora", ``adapter.lora.alpha``, and a pair per projection named after the base
tensor (``blk.3.attn_q.weight.lora_a`` [r, in], ``.lora_b`` [out, r]). llama.cpp's converter
permutes a Llama's q and k rows for its rotary layout, in B as in the base weight, so B's rows are
put back in Hugging Face's order here as the base loader does. The scale is llama.cpp's:
``alpha / rank``, or 1 when alpha is 0.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pagoda.loader.gguf_file import read_gguf
from pagoda.loader.gguf_weights import gguf_to_hf_name, unpermute_rows
from pagoda.lora.adapter import AdapterError, LoRAPair, PeftAdapter
from pagoda.lora.peft_adapter import check_shapes
from pagoda.models.architectures import GGUF_WRITE_ARCHITECTURES

def read_gguf_adapter(path: Path, hf_config: dict, max_rank: int) -> PeftAdapter:
    try:
        gf = read_gguf(path)
    except ValueError as exc:
        raise AdapterError(str(exc)) from None
    meta = gf.metadata
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise AdapterError(f"{path} is a GGUF {meta.get('general.type', 'model')!r}, not a LoRA adapter "
                           "(general.type 'adapter', adapter.type 'lora')")
    model_type = hf_config.get("model_type")
    arch, want = gf.architecture, GGUF_WRITE_ARCHITECTURES.get(model_type)
    if want is not None and arch != want:
        raise AdapterError(f"adapter {path} was made for a {arch!r} model, this base is {want!r}")
    halves: dict[str, dict[str, np.ndarray]] = {}
    for name, info in gf.tensors.items():
        base, _, half = name.rpartition(".")
        hf = gguf_to_hf_name(base, arch, model_type) if half in ("lora_a", "lora_b") else None
        if hf is None or not hf.startswith("model.layers."):
            raise AdapterError(f"adapter {path} holds {name}, which pagoda does not apply (LoRA pairs of the "
                               "attention and MLP projections only)")
        halves.setdefault(hf.removeprefix("model.").removesuffix(".weight"), {})[half] = gf.dequantized(info)
    if not halves:
        raise AdapterError(f"adapter {path} holds no LoRA weights")
    alpha = float(meta.get("adapter.lora.alpha", 0.0))
    pairs = {module: _pair(module, half, alpha, arch, hf_config, path) for module, half in halves.items()}
    rank = max(p.a.shape[0] for p in pairs.values())
    if rank > max_rank:
        raise AdapterError(f"adapter {path} has rank {rank}, above the server's --max-lora-rank {max_rank}")
    check_shapes(pairs, hf_config, path)
    return PeftAdapter(str(path), rank, pairs)


def _pair(module: str, half: dict[str, np.ndarray], alpha: float, arch: str, hf_config: dict, path: Path) -> LoRAPair:
    if set(half) != {"lora_a", "lora_b"}:
        raise AdapterError(f"adapter {path}: {module} has {''.join(half)} without its other half")
    a, b = half["lora_a"], half["lora_b"]
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
        raise AdapterError(f"adapter {path}: {module}'s pair has shapes {a.shape} and {b.shape}")
    if arch == "llama" and module.endswith(("q_proj", "k_proj")):
        heads = hf_config["num_attention_heads"]
        heads = heads if module.endswith("q_proj") else hf_config.get("num_key_value_heads") or heads
        b = unpermute_rows(b, heads)
    rank = a.shape[0]
    return LoRAPair(torch.from_numpy(np.array(a, dtype=np.float32)), torch.from_numpy(np.array(b, dtype=np.float32)),
                    alpha / rank if alpha else 1.0)
