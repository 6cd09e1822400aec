"""An image from what a request sends (a ``data:`` URL, base64, a ``file://`` URL, an allowed
remote URL, a PIL image), decoded and checked: a clear ValueError (a 400 at the servers) for
anything that is not a readable image of an allowed kind and size."""

from __future__ import annotations

import base64
import binascii
import io
import urllib.parse
import warnings
from pathlib import Path

from PIL import Image

from pagoda.multimodal.limits import ImageLimits

# the formats decoded (PIL opens more, e.g. EPS through Ghostscript, which a server must not run)
ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


class ImageError(ValueError):
    """An image a request sent cannot be used (the message says why)."""


def load_image(source: object, limits: ImageLimits, what: str = "image") -> Image.Image:
    """A PIL image from ``source``: a PIL image, raw bytes, or a URL string (see the module)."""
    if isinstance(source, Image.Image):
        _check_pixels(source, limits, what)
        return source
    if isinstance(source, (bytes, bytearray)):
        return decode_image(bytes(source), limits, what)
    if not isinstance(source, str):
        raise ImageError(f"{what} must be a URL or base64 text, got {type(source).__name__}")
    return decode_image(_fetch(source, limits, what), limits, what)


def image_from_base64(text: str, limits: ImageLimits, what: str = "image") -> Image.Image:
    """Ollama's ``images`` entries: plain base64 (a data: URL is taken too)."""
    if text.startswith("data:"):
        return decode_image(_data_url(text, what), limits, what)
    return decode_image(_b64(text, what), limits, what)


def decode_image(data: bytes, limits: ImageLimits, what: str = "image") -> Image.Image:
    if len(data) > limits.max_bytes:
        raise ImageError(f"{what} is {len(data)} bytes, more than the {limits.max_bytes} allowed")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
            _check_pixels(image, limits, what)
            image.load()
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageError(f"{what} has too many pixels") from None
    except Image.UnidentifiedImageError:
        raise ImageError(f"{what} is not an image of a supported type ({', '.join(ALLOWED_FORMATS)})") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise ImageError(f"{what} is corrupt: {e}") from None
    return image


def _check_pixels(image: Image.Image, limits: ImageLimits, what: str) -> None:
    width, height = image.size
    if width < 1 or height < 1:
        raise ImageError(f"{what} is empty ({width} x {height})")
    if width * height > limits.max_pixels:
        raise ImageError(f"{what} is {width} x {height} = {width * height} pixels, more than the {limits.max_pixels} "
                         "allowed (--max-image-pixels)")


def _fetch(url: str, limits: ImageLimits, what: str) -> bytes:
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == "data":
        return _data_url(url, what)
    if scheme == "file":
        return _local_file(url, limits, what)
    if scheme in ("http", "https"):
        return _remote(url, limits, what)
    raise ImageError(f"{what}: a URL must be data:, file: or http(s):, got {url[:40]!r}")


def _data_url(url: str, what: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise ImageError(f"{what}: a data: URL must be base64 (data:image/png;base64,...)")
    media = head[len("data:"):].split(";")[0].lower()
    if media and not media.startswith("image/"):
        raise ImageError(f"{what}: a data: URL of type {media!r} is not an image")
    return _b64(payload, what)


def _b64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{what} is not valid base64") from None


def _local_file(url: str, limits: ImageLimits, what: str) -> bytes:
    root = limits.allowed_local_media_path
    if root is None:
        raise ImageError(f"{what}: file: URLs are not allowed on this server (--allowed-local-media-path)")
    path = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).resolve()
    if not path.is_relative_to(root.resolve()):
        raise ImageError(f"{what}: {path} is outside the allowed media directory")
    if not path.is_file():
        raise ImageError(f"{what}: no such file {path}")
    if path.stat().st_size > limits.max_bytes:
        raise ImageError(f"{what} is {path.stat().st_size} bytes, more than the {limits.max_bytes} allowed")
    return path.read_bytes()


def _remote(url: str, limits: ImageLimits, what: str) -> bytes:
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if host not in limits.allowed_media_domains:
        raise ImageError(f"{what}: remote image URLs are not fetched unless their host is allowed "
                         "(--allowed-media-domains); send the image as a data: URL")
    import httpx  # deferred: only a server that allows remote images fetches any

    try:
        with httpx.stream("GET", url, timeout=10.0, follow_redirects=False) as response:
            response.raise_for_status()
            data = bytearray()
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) > limits.max_bytes:
                    raise ImageError(f"{what} is more than the {limits.max_bytes} bytes allowed")
            return bytes(data)
    except httpx.HTTPError as e:
        raise ImageError(f"{what}: could not fetch {url}: {e}") from None
