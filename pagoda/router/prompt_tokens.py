"""A request's prompt as the workers' engine will see it, token ids, for exact prefix routing on
the workers' KV events (`pagoda router --tokenizer MODEL`).

The router renders and tokenizes as `pagoda serve` does: a completion's text prompt with the
model's special tokens (engine/input_processor.py), token ids as they are; a chat's messages
(text parts joined) through the model's chat template, the rendered text then encoded without
adding special tokens again (entrypoints/openai/chat.py). A chat that declares tools is not
rendered here: how tools enter the prompt depends on the worker's tool-call format, which the
router does not know, so such a request is routed on the prefix tree of texts instead.
"""

from __future__ import annotations

import logging
from typing import Any

from pagoda.tokenizer import Tokenizer

logger = logging.getLogger("pagoda.router")


class PromptTokens:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def of(self, body: Any) -> list[int] | None:
        """The prompt's token ids, or None where the router cannot tell them (a batch of prompts,
        tools, content that is not text, a template that fails)."""
        if not isinstance(body, dict):
            return None
        try:
            if isinstance(body.get("messages"), list):
                return self._chat(body)
            return self._completion(body.get("prompt"))
        except Exception as exc:  # a template error or odd input: the worker will answer it; route without
            logger.debug("prompt not tokenized for routing: %s", exc)
            return None

    def _completion(self, prompt: Any) -> list[int] | None:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        return None

    def _chat(self, body: dict) -> list[int] | None:
        if body.get("tools"):
            return None
        messages = []
        for m in body["messages"]:
            content = m.get("content")
            if isinstance(content, list):
                if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                    return None
                content = "".join(p.get("text") or "" for p in content)
            message = {"role": m.get("role"), "content": content or ""}
            for name in ("tool_calls", "tool_call_id"):
                if m.get(name):
                    message[name] = m[name]
            messages.append(message)
        text = self.tokenizer.apply_chat_template(messages, body.get("add_generation_prompt", True),
                                                  **(body.get("chat_template_kwargs") or {}))
        return self.tokenizer.encode(text, add_special_tokens=False)
