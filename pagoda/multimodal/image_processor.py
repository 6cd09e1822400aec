"""An image to the pixel values a model takes, as its transformers image processor computes them
(the PIL backend: ``image_processing_backends.PilBackend`` and ``image_transforms``): to RGB
(transparency composited onto white), resized by PIL to the processor's size (Gemma 3's
height x width, or CLIP's shortest edge, then its centre cropped), rescaled in float64 and cast
to float32, normalized by the mean and standard deviation in float32. Read from the
model directory's ``preprocessor_config.json`` (or ``processor_config.json``'s
``image_processor``); tests compare the values with transformers' own processor."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image


@dataclass(frozen=True)
class ImageProcessorConfig:
    height: int
    width: int
    resample: int = 2  # PIL's BILINEAR (transformers' PILImageResampling numbering is PIL's)
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    do_convert_rgb: bool = True
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    shortest_edge: int | None = None  # CLIP's resize: this edge to this size, the aspect kept
    crop: tuple[int, int] | None = None  # CLIP's centre crop (height, width)

    @classmethod
    def read(cls, model_dir: Path, default_size: int) -> ImageProcessorConfig:
        """The processor's settings from a model directory; ``default_size`` (the vision tower's
        image size) where none is written."""
        raw = _processor_json(model_dir)
        if raw.get("do_pan_and_scan"):
            raise ValueError("do_pan_and_scan (Gemma 3's crops of wide images) is not supported")
        size = raw.get("size") or {}
        height = size.get("height") or size.get("shortest_edge") or default_size
        width = size.get("width") or size.get("shortest_edge") or default_size
        picked = {k: raw[k] for k in ("resample", "rescale_factor", "do_convert_rgb", "do_resize", "do_rescale",
                                      "do_normalize") if raw.get(k) is not None}
        if size.get("shortest_edge") and not size.get("height"):
            picked["shortest_edge"] = int(size["shortest_edge"])
        crop = raw.get("crop_size") or {}
        if raw.get("do_center_crop") and crop:
            picked["crop"] = (int(crop["height"]), int(crop["width"]))
        for key in ("image_mean", "image_std"):
            if raw.get(key) is not None:
                value = raw[key]
                picked[key] = tuple(value) if isinstance(value, list) else (float(value),) * 3
        return cls(int(height), int(width), **picked)


def _processor_json(model_dir: Path) -> dict:
    for name in ("preprocessor_config.json", "processor_config.json"):
        path = Path(model_dir) / name
        if path.exists():
            raw = json.loads(path.read_text())
            return raw.get("image_processor", raw) if name == "processor_config.json" else raw
    return {}


def to_rgb(image: Image.Image) -> np.ndarray:
    """uint8 [H, W, 3], transparency composited onto white (transformers' ``convert_to_rgb``)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return np.array(Image.alpha_composite(background, rgba).convert("RGB"))
    return np.array(image.convert("RGB"))


def preprocess(image: Image.Image, cfg: ImageProcessorConfig) -> torch.Tensor:
    """float32 [3, height, width]: the pixel values the processor gives for ``image``."""
    pixels = to_rgb(image) if cfg.do_convert_rgb else np.array(image)
    if cfg.do_resize:
        pixels = np.array(Image.fromarray(pixels).resize(_resized(pixels.shape[:2], cfg), resample=cfg.resample))
    if cfg.crop is not None:
        pixels = _center_crop(pixels, *cfg.crop)
    values = pixels
    if cfg.do_rescale:  # upcast first, as transformers does, then float32
        values = (pixels.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    if cfg.do_normalize:
        values = values.astype(np.float32) if not np.issubdtype(values.dtype, np.floating) else values
        mean = np.array(cfg.image_mean, dtype=values.dtype)
        std = np.array(cfg.image_std, dtype=values.dtype)
        values = (values - mean) / std
    return torch.from_numpy(np.ascontiguousarray(values.transpose(2, 0, 1)))


def _resized(shape: tuple[int, int], cfg: ImageProcessorConfig) -> tuple[int, int]:
    """PIL's (width, height) to resize to: the processor's size, or the shortest edge to
    ``shortest_edge`` (transformers' ``get_resize_output_image_size``: the long edge truncated)."""
    if cfg.shortest_edge is None:
        return cfg.width, cfg.height
    height, width = shape
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = cfg.shortest_edge, int(cfg.shortest_edge * long / short)
    return (new_short, new_long) if width <= height else (new_long, new_short)


def _center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' ``center_crop`` of [H, W, C]: the top-left corner at half the margin, rounded
    down; a side shorter than the crop is padded with zeros, the image centred (rounded up)."""
    h, w = pixels.shape[:2]
    if h < height or w < width:
        padded = np.zeros((max(h, height), max(w, width), pixels.shape[2]), dtype=pixels.dtype)
        top, left = -(-(padded.shape[0] - h) // 2), -(-(padded.shape[1] - w) // 2)
        padded[top : top + h, left : left + w] = pixels
        pixels, h, w = padded, padded.shape[0], padded.shape[1]
    top, left = (h - height) // 2, (w - width) // 2
    return pixels[top : top + height, left : left + width]
