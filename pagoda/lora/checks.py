"""The front end's check of a request's adapter, before it is queued: LoRA must be on, the
adapter's files must fit the base model and the rank limit (a clear error otherwise), and the
request carries the files' fingerprint the prefix cache keys on. Each adapter version (id and
path) is read once; later requests reuse the answer."""

from __future__ import annotations

import threading

from pagoda.lora.config import MODEL_ADAPTER_ID, LoRAConfig
from pagoda.lora.adapter_files import read_adapter
from pagoda.lora.request import LoRARequest


def model_adapter_rank(files, hf_config: dict) -> int | None:
    """The rank of a store model's own adapter (ModelFiles.adapter), checked against the base."""
    if files.adapter is None:
        return None
    return read_adapter(str(files.adapter), hf_config, max_rank=1 << 16).rank


class AdapterChecks:
    def __init__(self, config: LoRAConfig | None, hf_config: dict, model_adapter=None) -> None:
        """``model_adapter``: a store model's own adapter (a Modelfile's ADAPTER): the requests
        that name none run under it, as Ollama serves such a model."""
        self.config, self.hf_config = config, hf_config
        self._checked: dict[tuple[int, str], LoRARequest] = {}
        self._lock = threading.Lock()  # the server checks on its event loop and in worker threads
        self.default = None
        if model_adapter is not None:
            self.default = self.check(LoRARequest("model-adapter", MODEL_ADAPTER_ID, str(model_adapter)))

    def check(self, lora: LoRARequest | None) -> LoRARequest | None:
        """``lora`` checked and fingerprinted (the same object for the same version); the model's
        own adapter, or None, for a request that names none."""
        if lora is None:
            return self.default
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        if self.config is None:
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: this engine serves no adapters (start it with "
                             "enable_lora=True, --enable-lora)")
        key = (lora.lora_int_id, lora.lora_path)
        with self._lock:
            known = self._checked.get(key)
        if known is not None:
            return known
        read_adapter(lora.lora_path, self.hf_config, self.config.max_lora_rank)
        checked = lora.with_fingerprint()
        with self._lock:
            return self._checked.setdefault(key, checked)
