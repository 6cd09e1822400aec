"""Architecture name (config.json `architectures` or GGUF `general.architecture`) → model class.

Built from the one table of architectures (models/architectures.py) that the GGUF reader and
writer use too.
"""

from __future__ import annotations

import importlib

from torch import nn

from pagoda.models.architectures import ARCHITECTURES
from pagoda.models.architectures import GGUF_ARCHITECTURES as _GGUF


def _model_class(module: str, name: str) -> type[nn.Module]:
    return getattr(importlib.import_module(f"pagoda.models.{module}"), name)


MODEL_CLASSES: dict[str, type[nn.Module]] = {a.hf_class: _model_class(a.module, a.model_class) for a in ARCHITECTURES}

# GGUF general.architecture → config.json architecture name
GGUF_HF_CLASSES: dict[str, str] = {gguf: hf_class for gguf, (hf_class, _) in _GGUF.items()}


def supported_architectures() -> list[str]:
    return sorted(MODEL_CLASSES)


def resolve_architecture(hf_config: dict) -> tuple[str, type[nn.Module]]:
    names = hf_config.get("architectures") or []
    for name in names:
        if name in MODEL_CLASSES:
            return name, MODEL_CLASSES[name]
    raise ValueError(
        f"unsupported model architecture {names or hf_config.get('model_type')!r}; "
        f"pagoda supports: {', '.join(supported_architectures())}"
    )
