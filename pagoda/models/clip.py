"""CLIP's vision tower (transformers' ``CLIPVisionTransformer``) as LLaVA runs it: a class token
before the patches, a learned position embedding over both, a LayerNorm before the encoder
(``pre_layrnorm``, transformers' spelling), the encoder layers of models/siglip.py with quick
GELU, and the hidden state of ``feature_layer`` (LLaVA's ``vision_feature_layer``, -2: the
second-to-last layer's output), so the layers after it are not run."""

from __future__ import annotations

import torch
from torch import nn

from pagoda.models.siglip import VisionLayer, load_tower_weight


class ClipVisionEmbeddings(nn.Module):
    def __init__(self, hidden: int, image_size: int, patch_size: int, channels: int) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(hidden))
        self.patch_embedding = nn.Conv2d(channels, hidden, kernel_size=patch_size, stride=patch_size, bias=False)
        positions = (image_size // patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(positions, hidden, _weight=torch.empty(positions, hidden))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class ClipVisionTower(nn.Module):
    """pixel values [images, 3, size, size] → the hidden state of ``feature_layer`` [images, 1 + patches, hidden]."""

    def __init__(self, cfg: dict, feature_layer: int) -> None:
        super().__init__()
        hidden, eps, act = cfg["hidden_size"], cfg.get("layer_norm_eps", 1e-5), cfg.get("hidden_act", "quick_gelu")
        num_layers = cfg["num_hidden_layers"]
        # hidden_states[0] is the encoder's input, [i] layer i's output: feature_layer -k needs num_layers + 1 - k layers
        self.num_run = feature_layer if feature_layer >= 0 else num_layers + 1 + feature_layer
        if not 0 <= self.num_run <= num_layers:
            raise ValueError(f"vision_feature_layer={feature_layer} is not a layer of a {num_layers}-layer tower")
        self.embeddings = ClipVisionEmbeddings(hidden, cfg["image_size"], cfg["patch_size"], cfg.get("num_channels", 3))
        self.pre_layrnorm = nn.LayerNorm(hidden, eps=eps)
        self.layers = nn.ModuleList(VisionLayer(hidden, cfg["intermediate_size"], cfg["num_attention_heads"], eps, act)
                                    for _ in range(self.num_run))
        self.attention_chunk: int | None = None  # queries a chunk (None: all patches at once)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        for layer in self.layers:
            x = layer(x, self.attention_chunk)
        return x

    def load_weight(self, name: str, tensor: torch.Tensor) -> str | None:
        """The layers past ``feature_layer`` and the final LayerNorm are not run, so not kept."""
        index = name.removeprefix("encoder.layers.").split(".")[0]
        if name.startswith("encoder.layers.") and int(index) >= self.num_run:
            return None
        return load_tower_weight(self, name, tensor, unused=("post_layernorm.",))
