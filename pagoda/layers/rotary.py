"""Rotary position embedding (rotate-half convention, as Hugging Face stores Llama/Qwen weights).

The cos/sin tables are computed once per model, one row per position, with the rope scaling of
the config (``scaling``: the dict ``models/config.py:rope_scaling`` normalizes), as transformers'
``modeling_rope_utils`` computes the inverse frequencies:

- ``linear``: every frequency divided by ``factor``;
- ``llama3`` (Llama 3.1+): long wavelengths divided by ``factor``, short ones kept, a smooth blend
  between;
- ``yarn`` (Qwen2.5's long-context setting, DeepSeek): interpolation for low frequencies,
  extrapolation for high ones, a linear ramp between, and cos/sin scaled by the attention factor
  (``0.1 ln(factor) + 1`` by default);
- ``longrope`` (Phi-3's "su"): per-frequency divisors, ``short_factor`` up to the original
  context and ``long_factor`` past it, cos/sin scaled by ``sqrt(1 + ln(s) / ln(original))``.
  Here the row of position p uses the long factors exactly when p >= original_max_position_embeddings,
  and cached keys keep the rotation they were written with: what transformers' model computes for a
  cached decode step. transformers' generate() differs once a sequence passes the original context:
  it drops its cache and recomputes every position with the long factors (a prompt longer than the
  original context likewise gets long factors throughout); llama.cpp uses the long factors for
  everything once its context window is longer than the original. Within the original context all
  three agree.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagoda.layers.backend import current_backend


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1+ frequency scaling: long wavelengths are divided by `factor`, smoothly."""
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(powers: torch.Tensor, head_dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (transformers' ``_compute_yarn_parameters``) from ``powers`` (``base ** (2i / d)``):
    the inverse frequencies and the factor cos/sin are multiplied by."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times in `original`
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the frequency, 0: interpolate it
    inv_freq = 1.0 / powers
    return 1.0 / (factor * powers) * (1 - extrapolation) + inv_freq * extrapolation, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def longrope_attention_factor(scaling: dict) -> float:
    """LongRoPE's cos/sin factor: ``attention_factor``, else ``sqrt(1 + ln(s) / ln(original))``
    for the extension ``s`` (``factor``, else max / original positions), 1 without one."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None = None) -> None:
        super().__init__()
        self.head_dim, self.max_position, self.base, self.scaling = head_dim, max_position, base, scaling
        self.backend = current_backend()
        self.reset_cache()

    def reset_cache(self) -> None:
        """(Re)compute the cos/sin tables on CPU in fp32 (also after building the model on 'meta')."""
        head_dim, max_position, base, scaling = self.head_dim, self.max_position, self.base, self.scaling
        with torch.device("cpu"):
            cos, sin = self._tables(head_dim, max_position, base, scaling)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    @staticmethod
    def _tables(head_dim: int, max_position: int, base: float, scaling: dict | None):
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (base ** exponents)
        attention_factor = 1.0
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        t = torch.arange(max_position, dtype=torch.int64).float()
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type == "yarn":
            inv_freq, attention_factor = _yarn_inv_freq(base ** exponents, head_dim, base, scaling)
        elif rope_type == "longrope":
            short, long = (torch.tensor(scaling[k], dtype=torch.float32) for k in ("short_factor", "long_factor"))
            if short.numel() != head_dim // 2 or long.numel() != head_dim // 2:
                raise ValueError(f"longrope short_factor / long_factor need {head_dim // 2} entries each, "
                                 f"got {short.numel()} / {long.numel()}")
            powers = base ** exponents
            original = scaling["original_max_position_embeddings"]
            freqs = torch.where((t >= original).unsqueeze(1), torch.outer(t, 1.0 / (long * powers)),
                                torch.outer(t, 1.0 / (short * powers)))
            return _cos_sin(freqs, longrope_attention_factor(scaling))
        elif rope_type not in ("default", None):
            raise ValueError(f"rope scaling type {rope_type!r} is not supported (linear, llama3, yarn, longrope)")
        return _cos_sin(torch.outer(t, inv_freq), attention_factor)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hkv, D] → rotated (same shapes, same dtype); the C++ backend
        rotates in place."""
        return self.backend.rotary(q, k, positions, self.cos_cache, self.sin_cache)


def _cos_sin(freqs: torch.Tensor, attention_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[positions, head_dim / 2] angles → the cos and sin tables (rotate-half: each angle twice)."""
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention_factor, emb.sin() * attention_factor
