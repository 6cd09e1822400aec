"""Incremental detokenization that is right across multi-byte UTF-8 and byte-fallback tokens.

Decoding token by token breaks characters that span tokens (Chinese, emoji, byte-fallback
pieces) and loses leading spaces that some decoders strip at the start of a string. The usual
remedy (vLLM, TGI): decode a short window of the previous tokens together with the new ones and
emit only the text past the window's old end, and hold back text that ends in an incomplete
character (U+FFFD) until the next token completes it.
"""

from __future__ import annotations

from pagoda.tokenizer import Tokenizer

_INITIAL_WINDOW = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = list(prompt_token_ids[-_INITIAL_WINDOW:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.output_text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, new_token_ids: list[int]) -> str:
        """Add tokens; return the newly completed text (may be '' while a character is split)."""
        delta_parts = []
        for token in new_token_ids:
            self.tokens.append(token)
            prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
            full = self._decode(self.tokens[self.prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                delta_parts.append(full[len(prefix) :])
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.tokens)
        delta = "".join(delta_parts)
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """At the end of generation, emit whatever is still held back (even a broken char)."""
        if self.read_offset < len(self.tokens):
            prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
            full = self._decode(self.tokens[self.prefix_offset :])
            delta = full[len(prefix) :] if full.startswith(prefix) else ""
            self.read_offset = len(self.tokens)
            self.output_text += delta
            return delta
        return ""
