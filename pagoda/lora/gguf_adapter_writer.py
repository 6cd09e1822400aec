"""Writing a PEFT adapter as a GGUF LoRA file in llama.cpp's layout (what ``ADAPTER ./peft-dir``
in a Modelfile stores, as Ollama converts safetensors adapters to GGUF): each pair named after
its base tensor, a Llama's q/k B rows permuted like the base weight. Each pair's scale is
multiplied into its B and ``adapter.lora.alpha`` is 0 (llama.cpp's "scale 1"), so any PEFT
scaling (rsLoRA, per-module alpha) is kept exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pagoda.loader.gguf_writer_tensors import gguf_tensor_name, permute_qk
from pagoda.lora.peft_adapter import read_peft_adapter
from pagoda.models.architectures import GGUF_WRITE_ARCHITECTURES


def write_gguf_adapter(peft_dir: Path, hf_config: dict, out_path: Path, max_rank: int = 1 << 16) -> Path:
    import gguf  # deferred: gguf loads on first use

    adapter = read_peft_adapter(str(peft_dir), hf_config, max_rank)
    arch = GGUF_WRITE_ARCHITECTURES.get(hf_config.get("model_type", ""))
    if arch is None:
        raise ValueError(f"cannot write an adapter of a {hf_config.get('model_type')!r} model to GGUF")
    writer = gguf.GGUFWriter(str(out_path), arch)
    try:
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 0.0)
        for module, pair in sorted(adapter.pairs.items()):
            name = gguf_tensor_name(f"model.{module}.weight", arch)
            b = (pair.b * pair.scale).numpy()
            if arch == "llama" and module.endswith(("q_proj", "k_proj")):
                heads = hf_config["num_attention_heads"]
                b = permute_qk(b, heads if module.endswith("q_proj") else hf_config.get("num_key_value_heads") or heads)
            writer.add_tensor(f"{name}.lora_a", np.ascontiguousarray(pair.a.numpy(), dtype=np.float32))
            writer.add_tensor(f"{name}.lora_b", np.ascontiguousarray(b, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return out_path
