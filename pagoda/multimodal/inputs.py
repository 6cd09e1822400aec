"""The processed form of a prompt's images, as it travels from the front end to the workers.

An image becomes a run of placeholder tokens in the prompt (the model's image token, repeated as
many times as the vision encoder gives embeddings) and an ``ImageInput``: its pixel values as the
model's processor makes them, where its run starts and how long it is, and a hash of the pixels.
The hash keys the prefix cache (``cache_token_ids``): the same image is a hit, a different image
behind the same placeholder tokens never is.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ImageInput:
    pixel_values: torch.Tensor  # float32 [channels, height, width], as the processor gives them
    offset: int  # the prompt position of its first placeholder token
    length: int  # its placeholder tokens: the rows of embeddings the encoder gives for it
    hash: str  # SHA-256 of the pixel values (hex)

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def cache_key(self) -> int:
        """What stands for each of its placeholder tokens in the prefix cache's keys: a negative
        number (no token id is negative) from the pixels' hash."""
        return -1 - int(self.hash[:15], 16)


def pixel_hash(pixel_values: torch.Tensor) -> str:
    """SHA-256 of the pixel values' bytes and shape: equal pixels, equal hash."""
    digest = hashlib.sha256(str(tuple(pixel_values.shape)).encode())
    digest.update(pixel_values.contiguous().numpy().tobytes())
    return digest.hexdigest()


def cache_token_ids(token_ids: list[int], images: tuple[ImageInput, ...]) -> list[int]:
    """``token_ids`` with each image's placeholder tokens replaced by its ``cache_key``."""
    if not images:
        return token_ids
    keyed = list(token_ids)
    for image in images:
        keyed[image.offset : image.end] = [image.cache_key] * image.length
    return keyed


def fit_to_images(images: tuple[ImageInput, ...], start: int, num_new: int) -> int:
    """How many of ``num_new`` tokens from position ``start`` a step may compute so that it does
    not end inside an image's run: an image's tokens attend to each other both ways (Gemma 3), so
    a run is computed in one step. Less than ``num_new`` (maybe 0) when the step would cut one."""
    end = start + num_new
    for image in images:
        if image.offset < end < image.end:  # (a run begun before ``start`` came from the prefix cache whole)
            return max(0, image.offset - start)
    return num_new


class PromptIds(list):
    """A prompt's token ids (a list, so every path that counts or slices ids takes it unchanged)
    carrying the prompt's images, so the servers' paths from a request's messages to the engine
    need no second argument beside the ids."""

    images: tuple[ImageInput, ...] = ()

    @classmethod
    def with_images(cls, ids: list[int], images: tuple[ImageInput, ...]) -> PromptIds:
        out = cls(ids)
        out.images = tuple(images)
        return out


def after_prefix(prefix: list[int], ids: list[int]) -> list[int]:
    """``prefix + ids``, ``ids``' images (if any) moved along by the prefix's length."""
    images = images_of(ids)
    if not images:
        return prefix + ids
    moved = tuple(dataclasses.replace(image, offset=image.offset + len(prefix)) for image in images)
    return PromptIds.with_images(prefix + ids, moved)


def images_of(ids: list[int]) -> tuple[ImageInput, ...]:
    return getattr(ids, "images", ())
