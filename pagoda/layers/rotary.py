"""Rotary position embedding (rotate-half convention, as Hugging Face stores Llama/Qwen weights)."""

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
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        attention_factor = 1.0
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type not in ("default", None):
            raise ValueError(f"rope scaling type {rope_type!r} is not supported yet")
        t = torch.arange(max_position, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * attention_factor, emb.sin() * attention_factor

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hkv, D] → rotated (same shapes, same dtype); the C++ backend
        rotates in place."""
        return self.backend.rotary(q, k, positions, self.cos_cache, self.sin_cache)
