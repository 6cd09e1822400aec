"""Incremental detokenization that is right across multi-byte UTF-8 and byte-fallback tokens.

Decoding token by token breaks characters that span tokens (Chinese, emoji, byte-fallback
pieces) and loses leading spaces that some decoders strip at the start of a string. The usual
remedy (vLLM, TGI): decode a short window of the previous tokens together with the new ones and
emit only the text past the window's old end, and hold back text that ends in an incomplete
character (U+FFFD) until the next token completes it. tokenizers' ``DecodeStream`` does exactly
that in Rust, one call a token (two ``decode`` calls and their list slices in Python cost ~5x
more: at 64 streams that was most of the output processor's time a step); at the end, text
still held back is decoded here, broken character and all, so nothing is lost.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from pagoda.tokenizer import Tokenizer

_INITIAL_WINDOW = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        window = list(prompt_token_ids[-_INITIAL_WINDOW:])
        self._stream = DecodeStream(window, skip_special_tokens=skip_special_tokens)
        self._backend = tokenizer.backend
        self._context = window  # the last tokens whose text was emitted (the window for flush)
        self._pending: list[int] = []  # tokens whose text is held back (an incomplete character)
        self.output_text = ""

    def step(self, new_token_ids: list[int]) -> str:
        """Add tokens; return the newly completed text (may be '' while a character is split)."""
        delta = ""
        backend, pending = self._backend, self._pending  # (once: this runs for every stream every step)
        for token in new_token_ids:
            pending.append(token)
            try:
                chunk = self._stream.step(backend, token)
            except Exception:  # the window's text changed as tokens came (InvalidPrefix): decode it here
                chunk = self._decode_pending(final=False)
                self._stream = DecodeStream(self._context + pending, skip_special_tokens=self.skip_special_tokens)
            if chunk is not None:
                delta += chunk
                self._emitted()
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """At the end of generation, emit whatever is still held back (even a broken char)."""
        if not self._pending:
            return ""
        delta = self._decode_pending(final=True) or ""
        self._emitted()
        self.output_text += delta
        return delta

    def _emitted(self) -> None:
        """The held-back tokens' text went out: they join the window."""
        context = self._context  # in place: step() holds the pending list
        context += self._pending
        del context[:-_INITIAL_WINDOW]
        self._pending.clear()

    def _decode_pending(self, final: bool) -> str | None:
        """The held-back tokens' text (the window with them, less the window alone), or None
        while it ends in an incomplete character, unless ``final``."""
        prefix = self.tokenizer.decode(self._context, skip_special_tokens=self.skip_special_tokens)
        full = self.tokenizer.decode(self._context + self._pending, skip_special_tokens=self.skip_special_tokens)
        if not final and (len(full) <= len(prefix) or full.endswith("\ufffd")):
            return None
        return full[len(prefix) :]
