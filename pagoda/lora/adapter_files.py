"""An adapter's files, whichever form they take: a PEFT directory (lora/peft_adapter.py) or a
GGUF LoRA file as llama.cpp writes it (lora/gguf_adapter.py)."""

from __future__ import annotations

from pathlib import Path

from pagoda.lora.gguf_adapter import is_gguf_file, read_gguf_adapter
from pagoda.lora.adapter import PeftAdapter
from pagoda.lora.peft_adapter import read_peft_adapter


def read_adapter(path: str, hf_config: dict, max_rank: int) -> PeftAdapter:
    """The adapter at ``path``, checked against the base's config and the rank limit."""
    if is_gguf_file(Path(path)):
        return read_gguf_adapter(Path(path), hf_config, max_rank)
    return read_peft_adapter(path, hf_config, max_rank)
