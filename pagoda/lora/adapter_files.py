"""An adapter's files, whichever form they take: a PEFT directory (lora/peft_adapter.py) or a
GGUF LoRA file as llama.cpp writes it (lora/gguf_adapter.py)."""

from __future__ import annotations

from pathlib import Path

from pagoda.lora.adapter import PeftAdapter
from pagoda.lora.peft_adapter import read_peft_adapter

GGUF_MAGIC = b"GGUF"


def is_gguf_file(path: Path) -> bool:
    if not path.is_file():
        return False
    with open(path, "rb") as fh:
        return fh.read(4) == GGUF_MAGIC


def read_adapter(path: str, hf_config: dict, max_rank: int) -> PeftAdapter:
    """The adapter at ``path``, checked against the base's config and the rank limit."""
    if is_gguf_file(Path(path)):
        # deferred: loads gguf, whose import brings a second OpenMP runtime into the server's process
        from pagoda.lora.gguf_adapter import read_gguf_adapter

        return read_gguf_adapter(Path(path), hf_config, max_rank)
    return read_peft_adapter(path, hf_config, max_rank)
