"""Gemma 3 with its vision path (``Gemma3ForConditionalGeneration``, Gemma 3 4B and up): the text
model of models/gemma3.py, a SigLIP tower (models/siglip.py) and the multi-modal projector.

As transformers' modeling_gemma3.py computes it: an image's patches go through the tower; the
projector average-pools them to ``mm_tokens_per_image`` (a square grid), applies Gemma's RMSNorm
(``1 + w``) and one matmul into the text model's width. Those rows replace the embeddings of the
image's placeholder tokens (``image_token_id``; text embeddings are scaled by sqrt(hidden), image
rows are not). In the text model an image's tokens attend to each other both ways
(``bidirectional_image_attention``: transformers' ``token_type_ids`` mask), causally otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.models.gemma3 import Gemma3ForCausalLM
from pagoda.models.siglip import SiglipVisionTower
from pagoda.models.vision_language import VisionLanguage


class _NormWeight(nn.Module):
    """Gemma's RMSNorm weight under its checkpoint name (``mm_soft_emb_norm.weight``), applied by the projector."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))


class Gemma3Projector(nn.Module):
    def __init__(self, vision: dict, text_hidden: int, tokens_per_image: int) -> None:
        super().__init__()
        hidden = vision["hidden_size"]
        self.mm_input_projection_weight = nn.Parameter(torch.empty(hidden, text_hidden))
        self.mm_soft_emb_norm = _NormWeight(hidden)
        self.eps = vision.get("layer_norm_eps", 1e-6)
        self.patches_per_side = vision["image_size"] // vision["patch_size"]
        tokens_per_side = int(tokens_per_image ** 0.5)
        if tokens_per_side ** 2 != tokens_per_image or self.patches_per_side % tokens_per_side:
            raise ValueError(f"mm_tokens_per_image={tokens_per_image} is not a square grid that pools "
                             f"{self.patches_per_side} x {self.patches_per_side} patches")
        self.kernel = self.patches_per_side // tokens_per_side

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[images, patches, vision hidden] → [images, tokens per image, text hidden]."""
        batch, _, hidden = patches.shape
        grid = patches.transpose(1, 2).reshape(batch, hidden, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        x = pooled.float()  # Gemma's RMSNorm: in float32, times (1 + w)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = (x * (1.0 + self.mm_soft_emb_norm.weight.float())).type_as(pooled)
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(patches)


class Gemma3ForConditionalGeneration(VisionLanguage, Gemma3ForCausalLM):
    bidirectional_image_attention = True

    def __init__(self, hf_config: dict, max_position: int) -> None:
        super().__init__(hf_config, max_position)
        vision = hf_config["vision_config"]
        self.image_token_id = int(hf_config.get("image_token_id", 262_144))
        self.tokens_per_image = int(hf_config.get("mm_tokens_per_image", 256))
        self.vision_tower = SiglipVisionTower(vision)
        self.multi_modal_projector = Gemma3Projector(vision, self.config.hidden_size, self.tokens_per_image)
