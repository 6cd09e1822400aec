"""SigLIP's vision tower (transformers' ``SiglipVisionTransformer``): patches, a learned position
embedding, pre-norm encoder layers with bidirectional attention over the patches, a final
LayerNorm. Gemma 3's vision path runs it without the pooling head (``vision_use_head: false``).

Attention over an image's patches can run in chunks of queries (``attention_chunk``): each chunk
attends to every patch, so the result is the same, and the scores held at once shrink from
patches² to chunk × patches per head (benchmarks/README.md measures the memory and time).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
        batch, patches, _ = x.shape
        shape = (batch, patches, self.num_heads, self.head_dim)
        q, k, v = (p(x).view(shape).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        scale = self.head_dim ** -0.5
        if chunk is None or chunk >= patches:
            out = F.scaled_dot_product_attention(q, k, v, scale=scale)
        else:  # a chunk of queries at a time, each over every patch: the same attention, less memory
            out = torch.cat([F.scaled_dot_product_attention(q[:, :, i : i + chunk], k, v, scale=scale)
                             for i in range(0, patches, chunk)], dim=2)
        return self.out_proj(out.transpose(1, 2).reshape(batch, patches, -1))


# a vision config's hidden_act → the function (SigLIP's tanh GELU, CLIP's quick GELU)
ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
               "gelu": F.gelu, "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"vision_config.hidden_act {name!r} is not supported ({', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    """A pre-norm encoder layer (SigLIP's and CLIP's)."""

    def __init__(self, hidden: int, intermediate: int, num_heads: int, eps: float, act: str) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.self_attn = VisionAttention(hidden, num_heads)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = VisionMLP(hidden, intermediate, act)

    def forward(self, x: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), chunk)
        return x + self.mlp(self.layer_norm2(x))


class VisionEmbeddings(nn.Module):
    def __init__(self, hidden: int, image_size: int, patch_size: int, channels: int) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(channels, hidden, kernel_size=patch_size, stride=patch_size)
        self.num_patches = (image_size // patch_size) ** 2
        self.position_embedding = nn.Embedding(self.num_patches, hidden, _weight=torch.empty(self.num_patches, hidden))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight


class SiglipVisionTower(nn.Module):
    """pixel values [images, 3, size, size] → last hidden state [images, patches, hidden]."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        hidden, eps, act = cfg["hidden_size"], cfg.get("layer_norm_eps", 1e-6), cfg.get("hidden_act", "gelu_pytorch_tanh")
        self.image_size, self.patch_size = cfg["image_size"], cfg["patch_size"]
        self.embeddings = VisionEmbeddings(hidden, self.image_size, self.patch_size, cfg.get("num_channels", 3))
        self.layers = nn.ModuleList(VisionLayer(hidden, cfg["intermediate_size"], cfg["num_attention_heads"], eps, act)
                                    for _ in range(cfg["num_hidden_layers"]))
        self.post_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.attention_chunk: int | None = None  # queries a chunk (None: all patches at once)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values)
        for layer in self.layers:
            x = layer(x, self.attention_chunk)
        return self.post_layernorm(x)

    def load_weight(self, name: str, tensor: torch.Tensor) -> str | None:
        return load_tower_weight(self, name, tensor, unused=("head.",))


def load_tower_weight(tower: nn.Module, name: str, tensor: torch.Tensor, unused: tuple[str, ...] = ()) -> str | None:
    """One checkpoint tensor, named under the tower (``encoder.layers.0...``, ``embeddings...``);
    names starting with one of ``unused`` (a pooling head the path does not run) are skipped.
    Returns the parameter's name (None: skipped)."""
    if name.startswith(unused):
        return None
    name = name.removeprefix("encoder.")
    param = dict(tower.named_parameters()).get(name)
    if param is None:
        raise ValueError(f"checkpoint tensor vision_tower.{name!r} has no place in the {type(tower).__name__}")
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"vision tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(tensor)
    return name
