"""A model's own sampling defaults, from its `generation_config.json` (vLLM's `--generation-config`).

Model authors ship recommended settings there (Hugging Face names), and pagoda's store writes a
model's Modelfile PARAMETERs there too (store/load.py: temperature, top_p, top_k, min_p,
repeat_penalty, seed, num_predict). With `--generation-config auto` (the default, as in vLLM)
they become the defaults of every request that does not set them itself: in the OpenAI and
Ollama APIs, in `/v1/sessions`, and in `LLM.generate` / `LLM.chat` called without sampling
parameters. `--generation-config vllm` ignores the file (pagoda's and OpenAI's defaults); a
directory path reads the file there instead. As in vLLM, only sampling keys are read, and
`do_sample` is not (a file may say `temperature` beside `do_sample: false`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# generation_config.json key → SamplingParams field, with the type the value must have
_KEYS: dict[str, tuple[str, type]] = {
    "temperature": ("temperature", float), "top_p": ("top_p", float), "top_k": ("top_k", int),
    "min_p": ("min_p", float), "repetition_penalty": ("repetition_penalty", float),
    "max_new_tokens": ("max_tokens", int), "seed": ("seed", int),
}


def sampling_defaults(source: str, metadata_dir: Path) -> dict[str, Any]:
    """SamplingParams fields → the model's default values (empty when there are none)."""
    if source == "vllm":
        return {}
    folder = Path(metadata_dir) if source == "auto" else Path(source).expanduser()
    path = folder / "generation_config.json"
    if source != "auto" and not path.is_file():
        raise ValueError(f"generation_config: {path} does not exist (give auto, vllm, or a folder holding it)")
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError as e:
        raise ValueError(f"generation_config: {path} is not valid JSON: {e}") from None
    defaults: dict[str, Any] = {}
    for key, (field, kind) in _KEYS.items():
        value = config.get(key)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if kind is int and value != int(value):
            continue
        defaults[field] = kind(value)
    if defaults.get("max_tokens", 1) < 1:  # num_predict -1: until the context is full
        del defaults["max_tokens"]
    if defaults:
        logger.info("default sampling parameters from %s: %s (--generation-config vllm ignores them)", path, defaults)
    return defaults
