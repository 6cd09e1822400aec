"""What ``pagoda show`` says about a GGUF: architecture, parameters, quantization, context length,
embedding length, its own chat template. Read with the ``gguf`` package (memory-mapped; no
tensor is loaded)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _field(reader, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        return field.contents()
    except Exception:  # an odd field type: leave it out rather than fail `show`
        return None


def human_count(n: int) -> str:
    """Ollama's parameter-size style: 135M, 1.2B."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f}{unit}" if value >= 100 or value == int(value) else f"{value:.1f}{unit}"
    return str(n)


def gguf_info(path: Path) -> dict[str, Any]:
    import gguf  # deferred: gguf loads on first use
    import numpy as np  # deferred: numpy loads on first use

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    arch = _field(reader, "general.architecture") or "unknown"
    n_params = int(sum(int(np.prod(t.shape)) for t in reader.tensors))
    file_type = _field(reader, "general.file_type")
    quantization = None
    if file_type is not None:
        try:
            quantization = gguf.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            quantization = f"file_type {file_type}"
    if quantization is None and reader.tensors:  # no file type stated: the commonest tensor type
        types = [t.tensor_type.name for t in reader.tensors]
        quantization = max(set(types), key=types.count)
    return {
        "architecture": arch,
        "name": _field(reader, "general.name"),
        "parameters": n_params,
        "parameter_size": human_count(n_params),
        "quantization": quantization,
        "context_length": _field(reader, f"{arch}.context_length"),
        "embedding_length": _field(reader, f"{arch}.embedding_length"),
        "block_count": _field(reader, f"{arch}.block_count"),
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }


def parameter_count(weights: list[Path]) -> int:
    """Exact, from the files' headers (no tensor is read): GGUF via gguf_info, safetensors by
    their JSON header."""
    total = 0
    for path in weights:
        try:
            if path.suffix == ".gguf":
                total += gguf_info(path)["parameters"]
                continue
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            for name, meta in header.items():
                if name != "__metadata__":
                    count = 1
                    for dim in meta["shape"]:
                        count *= dim
                    total += count
        except (OSError, ValueError, KeyError):
            return 0
    return total
