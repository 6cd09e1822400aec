"""Pixel values equal transformers' image processor's, bit for bit: Gemma 3's and LLaVA's CLIP
processor (the shortest edge resized, the centre cropped; on the tiny models' processor files)
for images of every mode and shape, and the real Gemma 3 processor's settings
(896 x 896, preprocessor_config.json beside processor_config.json, as the hub ships them)."""

from __future__ import annotations

import json

import pytest
import torch
from vision_models import make_tiny_gemma3_vision, make_tiny_llava, random_image

from pagoda.multimodal.image_processor import ImageProcessorConfig, preprocess

IMAGES = [((40, 30), "RGB"), ((100, 70), "RGBA"), ((20, 90), "L"), ((56, 56), "RGB"), ((1, 1), "RGB")]


@pytest.fixture(scope="module", params=["gemma3", "llava"])
def model_dir(request, tmp_path_factory):
    make = make_tiny_gemma3_vision if request.param == "gemma3" else make_tiny_llava
    return make(tmp_path_factory.mktemp(f"{request.param}-processor") / "m")


@pytest.mark.parametrize("size, mode", IMAGES + [((29, 300), "RGB"), ((300, 29), "RGB")])
def test_pixel_values_equal_the_processors(model_dir, size, mode):
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(model_dir).image_processor
    image = random_image(sum(size) + len(mode), size, mode)
    want = processor(images=[image], return_tensors="pt")["pixel_values"][0]
    got = preprocess(image, ImageProcessorConfig.read(model_dir, 0))
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_the_hub_layout_of_gemma3s_processor(tmp_path):
    """preprocessor_config.json as google/gemma-3-4b-it ships it, read as transformers reads it."""
    import transformers

    config = {"do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True,
              "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "Gemma3ImageProcessor",
              "image_seq_length": 256, "image_std": [0.5, 0.5, 0.5], "resample": 2,
              "rescale_factor": 0.00392156862745098, "size": {"height": 896, "width": 896}}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path)
    image = random_image(3, (1024, 600))
    want = processor(images=[image], return_tensors="pt")["pixel_values"][0]
    assert torch.equal(preprocess(image, ImageProcessorConfig.read(tmp_path, 224)), want)


def test_pan_and_scan_is_refused(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"do_pan_and_scan": True}))
    with pytest.raises(ValueError, match="pan_and_scan"):
        ImageProcessorConfig.read(tmp_path, 896)
