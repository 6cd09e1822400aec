"""The prompt token ids of `/api/generate` (raw, the model's chat template, or the request's own Go
`template`) and of `/api/chat` (the chat template, with tools). The routes call these off the event
loop (generation.py): rendering and tokenizing cost time in proportion to what a request sends."""

from __future__ import annotations

from typing import Any

from jinja2.exceptions import TemplateError

from pagoda.entrypoints.ollama.common import ChatBody, GenerateBase, GenerateBody, OllamaError
from pagoda.entrypoints.openai.chat_images import content_text
from pagoda.entrypoints.openai.serving import Serving
from pagoda.multimodal.image_loading import image_from_base64
from pagoda.multimodal.inputs import after_prefix
from pagoda.entrypoints.openai.tool_calls import ToolChoice, render_messages
from pagoda.store.gotemplate import to_jinja
from pagoda.tokenizer import RenderTooLong, compile_template, render_bounded


def generate_prompt(serving: Serving, body: GenerateBody) -> list[int]:
    tokenizer = serving.tokenizer
    prompt = body.prompt or ""
    serving.check_prompt_chars(len(prompt) + len(body.system or ""))
    serving.check_input([prompt, body.system or ""])  # the content filter (--moderation-words)
    if body.raw:
        if body.system or body.template:
            raise OllamaError("raw prompts take no `system` or `template`")
        ids = tokenizer.encode(prompt) if not body.images else \
            _raw_with_images(serving, prompt, images_of_request(serving, body.images, "images"))
    else:
        messages = ([{"role": "system", "content": body.system}] if body.system else []) + \
                   [{"role": "user", "content": with_images(serving, prompt, body.images, "images")}]
        if body.template and body.images:
            raise OllamaError("images with a request's own `template` are not supported: use the model's")
        if body.template:
            ids = tokenizer.encode(render_go_template(serving, body.template, messages), add_special_tokens=False)
        elif tokenizer.chat_template:
            ids = serving.encode_chat(messages, True, **think_kwargs(body))
        elif body.images:
            raise OllamaError("images need the model's chat template, and this model has none")
        else:  # no template: the prompt as given (Ollama's default template is `{{ .Prompt }}`)
            ids = tokenizer.encode(f"{body.system}\n\n{prompt}" if body.system else prompt)
    return after_prefix(list(body.context or []), ids)


def images_of_request(serving: Serving, images: list[str] | None, where: str) -> list:
    """Ollama's ``images`` (base64), decoded and checked: a 400 naming the entry otherwise."""
    if not images:
        return []
    prompts = serving.engine.input_processor.images
    if prompts is None:
        raise OllamaError(f"{where}: this model takes no images (a vision-language model does)")
    decoded = []
    for j, text in enumerate(images):
        if not isinstance(text, str):
            raise OllamaError(f"{where}.{j}: an image must be base64 text")
        try:
            decoded.append(image_from_base64(text, prompts.limits, f"{where}.{j}"))
        except ValueError as e:
            raise OllamaError(str(e)) from None
    return decoded


def with_images(serving: Serving, text: str, images: list[str] | None, where: str) -> str | list[dict]:
    """A message's content for the template: the text, or its images (as Ollama places them,
    before the text) and the text as parts (chat_images.py renders them through encode_chat)."""
    decoded = images_of_request(serving, images, where)
    if not decoded:
        return text
    return [{"type": "image", "image": image} for image in decoded] + [{"type": "text", "text": text}]


def _raw_with_images(serving: Serving, prompt: str, images: list) -> list[int]:
    """A raw prompt with images: its text marks each image itself (the model's marker)."""
    try:
        return serving.engine.input_processor.images.from_text(prompt, images)
    except ValueError as e:
        raise OllamaError(str(e)) from None


def render_go_template(serving: Serving, template: str, messages: list[dict]) -> str:
    """A request's `template` (an Ollama Go template), through pagoda's Go → Jinja converter. The
    rendering stops once it passes what the whole context could hold (as check_prompt_chars counts
    it): a template's loops can render far more than it is long."""
    limit = serving.max_model_len * serving.max_token_chars
    try:
        jinja = compile_template(to_jinja(template))
        tokenizer = serving.tokenizer
        return render_bounded(jinja, limit, messages=messages, add_generation_prompt=True,
                              bos_token=tokenizer.bos_token or "", eos_token=tokenizer.eos_token or "")
    except RenderTooLong:
        raise OllamaError(f"template: the prompt it renders passes {limit} characters, more than this model's "
                          f"context of {serving.max_model_len} tokens can hold") from None
    except (ValueError, TemplateError) as e:  # the converter's ValueError, or Jinja's errors
        raise OllamaError(f"template: {e}") from None


def chat_prompt(serving: Serving, body: ChatBody, tools: ToolChoice | None) -> list[int]:
    messages = []
    for i, m in enumerate(body.messages or []):
        message = {"role": m.role, "content": with_images(serving, m.content or "", m.images, f"messages.{i}.images")}
        if m.tool_calls:
            message["tool_calls"] = [_template_call(call, i) for call in m.tool_calls]
        if m.tool_name:
            message["name"] = m.tool_name
        messages.append(message)
    serving.check_prompt_chars(sum(len(content_text(m["content"])) for m in messages), "messages")
    serving.check_input([content_text(m["content"]) for m in messages], "messages")  # the content filter (--moderation-words)
    template = serving.tokenizer.chat_template
    if not template:
        raise OllamaError("this model has no chat template (a base model: use /api/generate); to chat with it "
                          "anyway, start the server with --chat-template")
    try:
        messages, extra = render_messages(messages, tools, template_takes_tools="tools" in template)
    except (ValueError, TypeError, KeyError) as e:
        raise OllamaError(f"messages cannot be rendered with tools: {e!s}") from None
    return serving.encode_chat(messages, True, **extra, **think_kwargs(body))


def think_kwargs(body: GenerateBase) -> dict:
    """`think` for the chat template: `enable_thinking` (Qwen3's and others' switch), and a level
    ("low", "medium", "high") as `reasoning_effort`; nothing when the request does not say."""
    if body.think is None:
        return {}
    if isinstance(body.think, str):
        return {"enable_thinking": bool(body.think), "reasoning_effort": body.think} if body.think else {}
    return {"enable_thinking": body.think}


def _template_call(call: Any, i: int) -> dict:
    """An assistant message's earlier tool call, as Ollama sends it ({"function": {"name",
    "arguments": {...}}}), in the shape chat templates read (OpenAI's, arguments kept an object)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise OllamaError(f"messages.{i}.tool_calls: each call needs function.name")
    return {"type": "function", "function": {"name": function["name"], "arguments": function.get("arguments") or {}}}
