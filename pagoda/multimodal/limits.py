"""What a prompt's images may be: how many (``--limit-mm-per-prompt``, vLLM's flag), how many
pixels each (``--max-image-pixels``), how many bytes each encoded file; and where an image URL
may point (a ``data:`` URL always; a local file under ``--allowed-local-media-path``; a remote
URL only on a host of ``--allowed-media-domains``, both vLLM's flags: nothing is fetched unless
the operator allows it, so a request cannot make the server reach its own network)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MAX_IMAGES = 8
DEFAULT_MAX_PIXELS = 4096 * 4096  # 16.8 M pixels: a 4K photo fits, a decompression bomb does not
DEFAULT_MAX_BYTES = 20 * 2**20  # an encoded image file


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = DEFAULT_MAX_IMAGES
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_bytes: int = DEFAULT_MAX_BYTES
    allowed_local_media_path: Path | None = None
    allowed_media_domains: tuple[str, ...] = ()

    def check_count(self, count: int) -> None:
        if count > self.max_images:
            raise ValueError(f"the prompt has {count} images, more than this server allows in one prompt "
                             f"({self.max_images}, --limit-mm-per-prompt)")


def image_limits(args) -> ImageLimits:
    """The limits of an ``EngineArgs``' flags."""
    domains = tuple(d.strip().lower() for d in (args.allowed_media_domains or "").split(",") if d.strip())
    local = Path(args.allowed_local_media_path).expanduser() if args.allowed_local_media_path else None
    return ImageLimits(parse_limit_mm_per_prompt(args.limit_mm_per_prompt), args.max_image_pixels,
                       allowed_local_media_path=local, allowed_media_domains=domains)


def parse_limit_mm_per_prompt(value: str | dict | None) -> int:
    """The image count of ``--limit-mm-per-prompt`` ('{"image": 2}' as in vLLM, or ``image=2``)."""
    if value is None or value == "":
        return DEFAULT_MAX_IMAGES
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except ValueError as e:
                raise ValueError(f"--limit-mm-per-prompt is not JSON: {e}") from None
        else:
            value = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
    if not isinstance(value, dict) or set(value) - {"image"}:
        raise ValueError(f"--limit-mm-per-prompt: only 'image' is served, got {value!r}")
    count = value.get("image", DEFAULT_MAX_IMAGES)
    count = count.get("count", DEFAULT_MAX_IMAGES) if isinstance(count, dict) else count  # vLLM's {"count": n}
    try:
        count = int(count)
    except (TypeError, ValueError):
        raise ValueError(f"--limit-mm-per-prompt: image must be a count, got {count!r}") from None
    if count < 0:
        raise ValueError(f"--limit-mm-per-prompt: image must be >= 0, got {count}")
    return count
