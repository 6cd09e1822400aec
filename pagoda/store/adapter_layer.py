"""A model's LoRA adapter in the store (Ollama's ``application/vnd.ollama.image.adapter`` layer):
a Modelfile's ``ADAPTER`` checked against the model it is for, and stored as a GGUF adapter as
llama.cpp writes it (a PEFT directory is converted first, as Ollama converts safetensors ones)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from pagoda.lora.adapter_files import is_gguf_file, read_adapter
from pagoda.lora.gguf_adapter_writer import write_gguf_adapter
from pagoda.lora.adapter import AdapterError
from pagoda.store import blobs, manifests
from pagoda.store.layout import StoreLayout
from pagoda.store.manifests import Layer
from pagoda.store.modelfile import Modelfile, ModelfileError


def adapter_layer(layout: StoreLayout, modelfile: Modelfile, model: Layer) -> Layer:
    """The ADAPTER's layer for a model whose weights are the ``model`` layer."""
    from pagoda.loader.gguf_model_dir import load_gguf_model_dir  # deferred: loads gguf, numpy

    path, line = modelfile.adapter_path(), modelfile.adapter_line
    if path is None or not path.exists():
        raise ModelfileError(line, f"ADAPTER {modelfile.adapter}: no such file or directory")
    hf_config = json.loads((load_gguf_model_dir(layout.blob_path(model.digest)) / "config.json").read_text())
    try:
        if path.is_dir():
            with tempfile.TemporaryDirectory() as tmp:
                return _store(layout, write_gguf_adapter(path, hf_config, Path(tmp) / "adapter.gguf"))
        if not is_gguf_file(path):
            raise AdapterError(f"{path} is neither a GGUF LoRA adapter nor a PEFT directory")
        read_adapter(str(path), hf_config, max_rank=1 << 16)  # an adapter for this model, or the reason not
        return _store(layout, path)
    except AdapterError as exc:
        raise ModelfileError(line, f"ADAPTER {modelfile.adapter}: {exc}") from None


def _store(layout: StoreLayout, path: Path) -> Layer:
    return Layer(manifests.ADAPTER, blobs.import_file(layout, path), path.stat().st_size)
