"""Which torch dtype a `--dtype` or `--kv-cache-dtype` name means on this device ("auto" included)."""

from __future__ import annotations

import torch

from pagoda.engine_args import KV_CACHE_DTYPES
from pagoda.layers.dtype_choice import auto_cpu_dtype

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

_SCALED_KV = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
              "fp8_e5m2": torch.float8_e5m2}

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, quantization: str | None = None) -> torch.dtype:
    """``--kv-cache-dtype``: 'auto' keeps the model's dtype (exact), but for a GGUF's own quantized
    weights (``--quantization gguf``, already not exact) an fp32 model's cache is fp16, llama.cpp's
    default cache type: half the bytes a decode step's attention reads, twice the tokens in the
    same budget; bf16 / fp16 halve the cache of an fp32 model, its K/V rounded to nearest as they
    are written; int8 and fp8 (e4m3, the default fp8 as in vLLM, or e5m2) store codes per (token,
    head) with a float scale beside them."""
    key = str(name).lower()
    if key == "auto":
        return torch.float16 if quantization == "gguf" and model_dtype == torch.float32 else model_dtype
    if key in _SCALED_KV:
        return _SCALED_KV[key]
    if key not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return _DTYPES[key]


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """Map a user dtype ('auto', 'float32', 'bfloat16', 'float16') to a torch dtype.

    'auto' picks bf16 on CUDA; on a CPU, bf16 only where it measured faster than fp32 at one row
    and at a batch (layers/dtype_choice.py), else fp32.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
        return dtype
    name = str(dtype).lower()
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return auto_cpu_dtype()
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype!r}")
    return _DTYPES[name]
