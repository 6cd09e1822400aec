"""Images in chat messages: OpenAI's ``image_url`` content parts (a ``data:`` URL; a ``file://``
or remote URL where the server allows it, multimodal/limits.py) become the chat template's image
parts, ``{"type": "image"}`` as transformers' templates take them, each carrying its decoded
image; ``encode_chat`` (chat.py) renders the template and hands the text and the images to the
model's image path (multimodal/processor.py), which places the images' tokens."""

from __future__ import annotations

from PIL import Image

from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.entrypoints.openai.protocol import ChatMessage
from pagoda.multimodal.image_loading import load_image
from pagoda.multimodal.processor import ImagePrompts

IMAGE_PART_TYPES = ("image_url", "input_image")  # Chat Completions'; the Responses API's


def message_content(message: ChatMessage, index: int, prompts: ImagePrompts | None) -> str | list[dict]:
    """A message's content for the template: its text, or (with images) its parts in order."""
    parts = message.content
    if not isinstance(parts, list) or all(p.type == "text" for p in parts):
        return message.text()
    where = f"messages.{index}.content"
    out: list[dict] = []
    for j, part in enumerate(parts):
        if part.type == "text":
            out.append({"type": "text", "text": part.text or ""})
        elif part.type in IMAGE_PART_TYPES:
            if prompts is None:
                raise OpenAIError(f"{where}.{j}: this model takes no images (a vision-language model does)",
                                  param=where)
            out.append({"type": "image", "image": _image(part.image_url, prompts, f"{where}.{j}.image_url")})
        else:
            raise OpenAIError(f"{where}.{j}: content part type {part.type!r} is not supported; 'text' or 'image_url'",
                              param=f"{where}.{j}")
    return out


def _image(image_url, prompts: ImagePrompts, where: str) -> Image.Image:
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str) or not url:
        raise OpenAIError(f"{where}: give the image as {{\"url\": \"data:image/png;base64,...\"}}", param=where)
    try:
        return load_image(url, prompts.limits, where)
    except ValueError as e:
        raise OpenAIError(str(e), param=where) from None


def content_text(content: str | list[dict]) -> str:
    """The text of a message's content (its text parts), for the checks that read text."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if p.get("type") == "text")


def images_in(messages: list[dict]) -> list[Image.Image]:
    """The images of rendered messages, in the order their placeholders appear."""
    return [part["image"] for m in messages if isinstance(m.get("content"), list)
            for part in m["content"] if isinstance(part, dict) and part.get("type") == "image" and "image" in part]
