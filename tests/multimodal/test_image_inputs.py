"""The image inputs' rules on their own: the prefix cache's keys of image tokens, the step cut
that keeps an image's run whole, the attention mask of an image's tokens, --limit-mm-per-prompt's
forms, and the checks on what a request sends as an image."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from vision_models import random_image

from pagoda.layers.image_attention import image_mask
from pagoda.multimodal.image_loading import ImageError, decode_image, image_from_base64, load_image
from pagoda.multimodal.inputs import ImageInput, after_prefix, cache_token_ids, fit_to_images, pixel_hash
from pagoda.multimodal.limits import ImageLimits, parse_limit_mm_per_prompt


def _image(offset: int, length: int, seed: int = 0) -> ImageInput:
    pixels = torch.full((3, 4, 4), float(seed))
    return ImageInput(pixels, offset, length, pixel_hash(pixels))


def test_cache_keys_stand_for_the_pixels():
    ids = [5, 6, 7, 7, 7, 8]
    a, b = _image(2, 3, seed=1), _image(2, 3, seed=2)
    assert cache_token_ids(ids, ()) is ids
    keyed = cache_token_ids(ids, (a,))
    assert keyed[:2] == [5, 6] and keyed[5] == 8 and set(keyed[2:5]) == {a.cache_key} and a.cache_key < 0
    assert cache_token_ids(ids, (_image(2, 3, seed=1),)) == keyed  # equal pixels, equal keys
    assert cache_token_ids(ids, (b,)) != keyed


def test_a_step_never_ends_inside_an_image():
    images = (_image(4, 4), _image(10, 4))
    assert fit_to_images(images, 0, 3) == 3  # before the first
    assert fit_to_images(images, 0, 6) == 4  # would cut the first: stops before it
    assert fit_to_images(images, 4, 2) == 0  # cannot start it whole: waits
    assert fit_to_images(images, 0, 8) == 8  # ends right after it
    assert fit_to_images(images, 6, 4) == 4  # resumed after a cached part of it, ends at its end
    assert fit_to_images(images, 6, 1) == 0  # a cached part of it, the rest not whole: waits
    assert fit_to_images(images, 8, 4) == 2  # stops before the second


def test_image_tokens_attend_both_ways_within_their_image():
    mask = image_mask(torch.arange(6), torch.arange(6), ((2, 5),), None)
    assert mask[2, 4] and mask[3, 4] and not mask[1, 2] and not mask[4, 5] and mask[5, 2]
    assert torch.equal(mask & ~torch.ones(6, 6, dtype=torch.bool).tril(), torch.zeros(6, 6, dtype=torch.bool)
                       .index_put_((torch.tensor([2, 2, 3]), torch.tensor([3, 4, 4])), torch.tensor(True)))
    windowed = image_mask(torch.arange(6), torch.arange(6), ((2, 5),), 2)
    assert windowed[2, 4] and not windowed[5, 2]  # ahead inside the image; behind, the window counts


def test_a_prefix_moves_the_images_along():
    from pagoda.multimodal.inputs import PromptIds, images_of

    ids = PromptIds.with_images([1, 7, 7], (_image(1, 2),))
    moved = after_prefix([9, 9], ids)
    assert moved == [9, 9, 1, 7, 7] and images_of(moved)[0].offset == 3
    assert after_prefix([9], [1, 2]) == [9, 1, 2]


@pytest.mark.parametrize("value, count", [(None, 8), ('{"image": 2}', 2), ("image=3", 3), ({"image": {"count": 1}}, 1),
                                          ('{"image": 0}', 0)])
def test_limit_mm_per_prompt_forms(value, count):
    assert parse_limit_mm_per_prompt(value) == count


@pytest.mark.parametrize("value", ['{"video": 1}', '{"image": -1}', '{"image": "many"}', "{nope"])
def test_bad_limit_mm_per_prompt(value):
    with pytest.raises(ValueError, match="limit-mm-per-prompt"):
        parse_limit_mm_per_prompt(value)


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_what_a_request_may_send():
    limits = ImageLimits(max_pixels=1000, max_bytes=10_000)
    png = _png(random_image(1, (20, 20)))
    assert decode_image(png, limits).size == (20, 20)
    assert image_from_base64(base64.b64encode(png).decode(), limits).size == (20, 20)
    for bad, says in [(_png(random_image(2, (50, 50))), "pixels"), (_png(random_image(3, (20, 20)))[:100], "corrupt"),
                      (b"x" * 20_000, "bytes"), (b"%!PS-Adobe-3.0 EPSF-3.0\n", "not an image")]:
        with pytest.raises(ImageError, match=says):
            decode_image(bad, limits)
    with pytest.raises(ImageError, match="allowed-media-domains"):
        load_image("https://example.com/cat.png", limits)
    with pytest.raises(ImageError, match="allowed-local-media-path"):
        load_image("file:///etc/passwd", limits)
    with pytest.raises(ImageError, match="data:, file: or http"):
        load_image("ftp://example.com/cat.png", limits)
