"""LLaVA (``LlavaForConditionalGeneration``: LLaVA 1.5 and the models built the same way): a Llama
language model, a CLIP vision tower (models/clip.py) and a two-layer projector (linear, GELU,
linear), as transformers' modeling_llava.py computes it: the tower's ``vision_feature_layer``
hidden state, its class token dropped (``vision_feature_select_strategy`` "default") or kept
("full"), projected into the text model's width; those rows replace the embeddings of the
image's placeholder tokens (``image_token_index``). Image tokens attend causally, as text does."""

from __future__ import annotations

import torch
from torch import nn

from pagoda.models.clip import ClipVisionTower
from pagoda.models.llama import LlamaForCausalLM
from pagoda.models.siglip import activation
from pagoda.models.vision_language import VisionLanguage


class LlavaProjector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool, keep_cls: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)
        self.act = activation(act)
        self.keep_cls = keep_cls

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[images, 1 + patches, vision hidden] → [images, tokens per image, text hidden]."""
        return self.linear_2(self.act(self.linear_1(features if self.keep_cls else features[:, 1:])))


class LlavaForConditionalGeneration(VisionLanguage, LlamaForCausalLM):
    def __init__(self, hf_config: dict, max_position: int) -> None:
        super().__init__(hf_config, max_position)
        vision = hf_config["vision_config"]
        layer = hf_config.get("vision_feature_layer", -2)
        if not isinstance(layer, int):
            raise ValueError(f"vision_feature_layer={layer!r}: several feature layers are not supported")
        strategy = hf_config.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy={strategy!r} is not supported (default, full)")
        self.image_token_id = int(hf_config.get("image_token_id", 32_000))
        self.tokens_per_image = (vision["image_size"] // vision["patch_size"]) ** 2 + (strategy == "full")
        self.vision_tower = ClipVisionTower(vision, layer)
        self.multi_modal_projector = LlavaProjector(vision["hidden_size"], self.config.hidden_size,
                                                    hf_config.get("projector_hidden_act", "gelu"),
                                                    bool(hf_config.get("multimodal_projector_bias", True)),
                                                    keep_cls=strategy == "full")
