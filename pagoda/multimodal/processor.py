"""A prompt with images → its token ids with each image's placeholder run, and the images'
pixel values (``ImageInput``), as the model's transformers processor lays them out.

Gemma 3 (``Gemma3Processor``): each ``<start_of_image>`` in the text (what its chat template
writes for an image part) becomes ``\\n\\n<start_of_image>`` + ``mm_tokens_per_image`` image
tokens + ``<end_of_image>\\n\\n``, in the text, before tokenizing, so the ids are the
processor's. A prompt given as token ids has each ``<start_of_image>`` id expanded to the ids of
that sequence.

LLaVA (``LlavaProcessor``): each ``<image>`` becomes as many ``<image>`` tokens as the tower gives
rows (its patches, and the class token under ``vision_feature_select_strategy`` "full").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from pagoda.multimodal.image_loading import load_image
from pagoda.multimodal.image_processor import ImageProcessorConfig, preprocess
from pagoda.multimodal.inputs import ImageInput, PromptIds, pixel_hash
from pagoda.multimodal.limits import ImageLimits


@dataclass(frozen=True)
class PlaceholderStyle:
    """How one family marks an image in a prompt."""

    marker: str  # what the prompt writes for an image (the chat template's image part)
    image_token: str  # the token repeated once per embedding row
    tokens_per_image: int
    before: str = ""  # text around the run, as the processor writes it
    after: str = ""

    def expansion(self) -> str:
        return self.before + self.image_token * self.tokens_per_image + self.after


def placeholder_style(hf_config: dict, model_dir: Path, tokenizer) -> PlaceholderStyle:
    """The style of the model's family (Gemma 3's processor's ``image_seq_length`` where written)."""
    if hf_config.get("model_type") == "llava":
        vision = hf_config["vision_config"]
        tokens = (vision["image_size"] // vision["patch_size"]) ** 2 + \
            (hf_config.get("vision_feature_select_strategy", "default") == "full")
        image = tokenizer.convert_ids_to_tokens([int(hf_config.get("image_token_id", 32_000))])[0]
        return PlaceholderStyle(image, image, tokens)
    tokens = int(_processor_config(model_dir).get("image_seq_length") or hf_config.get("mm_tokens_per_image", 256))
    boi, eoi, image = tokenizer.convert_ids_to_tokens([int(hf_config.get("boi_token_id", 255_999)),
                                                       int(hf_config.get("eoi_token_id", 256_000)),
                                                       int(hf_config.get("image_token_id", 262_144))])
    return PlaceholderStyle(boi, image, tokens, before=f"\n\n{boi}", after=f"{eoi}\n\n")


def _processor_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "processor_config.json"
    return json.loads(path.read_text()) if path.exists() else {}


class ImagePrompts:
    """The front end's image path for one model: checks, preprocessing, placeholder expansion."""

    def __init__(self, hf_config: dict, model_dir: Path, tokenizer, limits: ImageLimits,
                 max_batched_tokens: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.style = placeholder_style(hf_config, model_dir, tokenizer)
        self.image_token_id = int(hf_config.get("image_token_id", 262_144))
        self.marker_id = tokenizer.token_to_id(self.style.marker)
        self.processor = ImageProcessorConfig.read(model_dir, hf_config["vision_config"]["image_size"])
        self.limits = limits
        if max_batched_tokens is not None and self.style.tokens_per_image > max_batched_tokens:
            # an image's run is computed in one step (its tokens attend to each other both ways)
            raise ValueError(f"an image takes {self.style.tokens_per_image} tokens, more than max_num_batched_tokens="
                             f"{max_batched_tokens}; raise --max-num-batched-tokens")

    @property
    def marker(self) -> str:
        """What a prompt's text holds for each image (the chat template's image part)."""
        return self.style.marker

    def from_text(self, text: str, images: list[Image.Image], add_special_tokens: bool = True) -> PromptIds:
        """The ids of a text prompt with ``images`` (a rendered chat template writes its special
        tokens itself: ``add_special_tokens=False``, as transformers' processors tokenize a chat)."""
        self._check_count(text.count(self.style.marker), images)
        expanded = text.replace(self.style.marker, self.style.expansion())
        return self._with_images(self.tokenizer.encode(expanded, add_special_tokens=add_special_tokens), images)

    def from_ids(self, ids: list[int], images: list[Image.Image]) -> PromptIds:
        """Token ids with one marker id per image, each expanded to the placeholder's ids."""
        self._check_count(ids.count(self.marker_id), images)
        run = self.tokenizer.encode(self.style.expansion(), add_special_tokens=False)
        out: list[int] = []
        for t in ids:
            out.extend(run if t == self.marker_id else (t,))
        return self._with_images(out, images)

    def check_no_image_tokens(self, ids: list[int]) -> None:
        """A prompt without images must not hold the image token (its rows would come from nowhere)."""
        if self.image_token_id in ids:
            raise ValueError(f"the prompt holds image tokens ({self.style.image_token!r}) but no images")

    def _check_count(self, markers: int, images: list[Image.Image]) -> None:
        self.limits.check_count(len(images))
        if markers != len(images):
            raise ValueError(f"the prompt has {markers} image placeholders ({self.style.marker!r}) for "
                             f"{len(images)} images: give one per image")

    def _with_images(self, ids: list[int], images: list[Image.Image]) -> PromptIds:
        per = self.style.tokens_per_image
        runs = image_runs(ids, self.image_token_id)
        if any(n % per for _, n in runs) or sum(n for _, n in runs) != per * len(images):
            raise ValueError(f"the prompt's image tokens ({self.style.image_token!r}) do not form one run of "
                             f"{per} per image: the text must not hold image tokens itself")
        # adjacent images' runs meet when nothing separates them (LLaVA's "<image><image>")
        offsets = [start + k * per for start, n in runs for k in range(n // per)]
        inputs = []
        for offset, image in zip(offsets, images):
            pixels = preprocess(image, self.processor)
            inputs.append(ImageInput(pixels, offset, per, pixel_hash(pixels)))
        return PromptIds.with_images(ids, tuple(inputs))


def image_runs(ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each run of ``token_id`` in ``ids``."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def image_prompts(hf_config: dict, model_dir: Path, tokenizer, limits: ImageLimits,
                  max_batched_tokens: int | None = None) -> ImagePrompts | None:
    """The image path of a vision-language model (None for a text model)."""
    if not isinstance(hf_config.get("vision_config"), dict):
        return None
    return ImagePrompts(hf_config, model_dir, tokenizer, limits, max_batched_tokens)


def multimodal_prompt(prompts: ImagePrompts | None, prompt: dict) -> tuple[str | None, PromptIds]:
    """vLLM's prompt with images, ``{"prompt": text or "prompt_token_ids": ids, "multi_modal_data":
    {"image": image or [images]}}`` (an image: a PIL image, bytes, a data: URL), processed."""
    if prompts is None:
        raise ValueError("this model takes no images (multi_modal_data): serve a vision-language model")
    data = prompt["multi_modal_data"]
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise ValueError(f"multi_modal_data: only 'image' is served, got {sorted(data) if isinstance(data, dict) else data!r}")
    given = data.get("image")
    given = [] if given is None else given if isinstance(given, (list, tuple)) else [given]
    images = [load_image(x, prompts.limits, f"multi_modal_data.image[{i}]") for i, x in enumerate(given)]
    if "prompt_token_ids" in prompt:
        return prompt.get("prompt"), prompts.from_ids(list(prompt["prompt_token_ids"]), images)
    if not isinstance(prompt.get("prompt"), str):
        raise ValueError("a prompt with multi_modal_data needs 'prompt' (text) or 'prompt_token_ids'")
    return prompt["prompt"], prompts.from_text(prompt["prompt"], images)


def chat_images(conversation: list[dict], prompts: ImagePrompts | None) -> tuple[list[dict], list[Image.Image]]:
    """``LLM.chat``'s messages with vLLM's image parts (``image_url`` with a URL, ``image_pil``
    with a PIL image, or ``image`` with either) as the template's ``{"type": "image"}``, and the
    images in order."""
    images: list[Image.Image] = []
    out = []
    for i, message in enumerate(conversation):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("image_url", "image_pil", "image"):
                parts.append(part)
                continue
            if prompts is None:
                raise ValueError(f"messages[{i}].content[{j}]: this model takes no images")
            source = part.get(kind)
            source = source.get("url") if isinstance(source, dict) else source
            images.append(load_image(source, prompts.limits, f"messages[{i}].content[{j}]"))
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, images
