"""A conversation's prompt as the engine computed it, so the next turn's prompt can start with
the same token ids ("incremental encoding", /v1/sessions and the Responses API's
`previous_response_id`): the prefix cache then holds the whole history, token for token, and
only the text the new turn adds is tokenized."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KnownPrefix:
    token_ids: list[int] = field(default_factory=list)  # the last turn's prompt and its answer, as generated
    text: str = ""  # token_ids decoded: the rendered conversation they stand for

    def encode(self, tokenizer, text: str) -> list[int]:
        """`text`'s token ids: this prefix's own and the tail encoded, when `text` extends it; else
        all of it encoded (a template that rewrote an earlier turn)."""
        if self.token_ids and text.startswith(self.text):
            return self.token_ids + tokenizer.encode(text[len(self.text):], add_special_tokens=False)
        return tokenizer.encode(text, add_special_tokens=False)

    @classmethod
    def of(cls, tokenizer, prompt_ids: list[int], answer_ids: list[int]) -> "KnownPrefix":
        ids = prompt_ids + answer_ids
        return cls(ids, tokenizer.decode(ids, skip_special_tokens=False))
