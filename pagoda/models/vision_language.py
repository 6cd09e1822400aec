"""What every vision-language model shares (models/gemma3_vision.py, models/llava.py): a
language model class it extends, a ``vision_tower`` and a ``multi_modal_projector`` beside it,
``encode_images`` (pixel values → the rows that replace an image's placeholder tokens), and the
checkpoint's names in either transformers layout: ``language_model.model.*`` /
``language_model.lm_head.*`` / ``vision_tower.vision_model.*`` (the hub's older files, and what
transformers 5 writes without the ``vision_model.`` level), or all of it under ``model.`` with
``lm_head.weight`` at the top (transformers 4.52 and after)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagoda.layers.stored_weights import PackedWeight

_VISION_PARTS = ("vision_tower.", "multi_modal_projector.")


class VisionLanguage:
    """A mixin before the language model's class: ``class M(VisionLanguage, LlamaForCausalLM)``."""

    vision_tower: nn.Module
    multi_modal_projector: nn.Module
    bidirectional_image_attention = False  # an image's tokens attend causally, as text does
    image_token_id: int

    @torch.no_grad()
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, 3, H, W] → the rows that replace their placeholder tokens [images, tokens, hidden]."""
        dtype = next(self.multi_modal_projector.parameters()).dtype
        return self.multi_modal_projector(self.vision_tower(pixel_values.to(dtype)))

    def text_parameters(self) -> dict[str, nn.Parameter]:
        return {name: p for name, p in self.named_parameters() if not name.startswith(_VISION_PARTS)}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | PackedWeight]]) -> None:
        """The language model's tensors through its own loader; the tower's and the projector's here."""
        loaded: set[str] = set()

        def text_weights():
            for name, tensor in weights:
                name = name.removeprefix("model.")
                if name.startswith("language_model."):
                    name = name.removeprefix("language_model.")
                    yield (name if name.startswith("lm_head.") else "model." + name.removeprefix("model.")), tensor
                elif name.startswith(_VISION_PARTS):
                    tensor = tensor.dequantize() if isinstance(tensor, PackedWeight) else tensor
                    loaded.add(self._load_vision(name, tensor))
                else:
                    yield name, tensor

        super().load_weights(text_weights())  # type: ignore[misc]
        expected = {f"vision_tower.{n}" for n, _ in self.vision_tower.named_parameters()} | \
                   {f"multi_modal_projector.{n}" for n, _ in self.multi_modal_projector.named_parameters()}
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} vision tensors, e.g. {sorted(missing)[:3]}")

    def _load_vision(self, name: str, tensor: torch.Tensor) -> str:
        """Copy one tensor of the tower or the projector; returns the parameter's name ("": not used)."""
        if name.startswith("vision_tower."):
            filled = self.vision_tower.load_weight(name.removeprefix("vision_tower.").removeprefix("vision_model."), tensor)
            return f"vision_tower.{filled}" if filled else ""
        part = name.removeprefix("multi_modal_projector.")
        param = dict(self.multi_modal_projector.named_parameters()).get(part)
        if param is None or tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint tensor {name} has no place in the projector")
        param.data.copy_(tensor)
        return name
