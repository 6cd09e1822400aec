"""vLLM's extension fields of a chat request (and OpenAI's own that the Responses and Messages
bodies name otherwise), which a Responses or Anthropic Messages body may carry too: they pass
through to the chat request the body is translated into."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

EXTENSION_FIELDS = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop",
                    "stop_token_ids", "logit_bias", "min_tokens", "ignore_eos", "priority", "cache_salt",
                    "speculative", "skip_special_tokens", "chat_template_kwargs", "guided_json", "guided_regex",
                    "guided_choice", "guided_grammar", "structured_outputs")


def extension_fields(body: BaseModel) -> dict[str, Any]:
    """The extension fields a body that allows extra fields was sent with."""
    extra = body.model_extra or {}
    return {name: extra[name] for name in EXTENSION_FIELDS if name in extra}
