"""Grammar compilation off the engine loop, one matcher per request, and the token bitmask.

A constrained request is added to the core at once, but the scheduler admits it only once its
grammar is compiled (`GrammarState.is_ready`). Compilation runs on a worker thread, so a slow
schema delays only its own request; equal constraints share one compilation (the cache is keyed
by the constraint). Each sampled token advances the request's matcher; when the grammar is
complete the request stops.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait, FIRST_COMPLETED
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pagoda.structured_output.grammar import build_grammar, constraint_key

if TYPE_CHECKING:
    from pagoda.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_CACHE_SIZE = 256


class GrammarState:
    """One request's view of its constraint: the compiled grammar (once ready) and its matcher."""

    def __init__(self, future: Future) -> None:
        self._future = future
        self._matcher = None

    def is_ready(self) -> bool:
        return self._future.done()

    @property
    def error(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None

    @property
    def matcher(self):
        if self._matcher is None:
            import xgrammar as xgr

            self._matcher = xgr.GrammarMatcher(self._future.result())
        return self._matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance the matcher; False when the token breaks the grammar (it was masked, so only
        a token forced past the mask, e.g. by min_tokens, can do that)."""
        return self.matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    # -- speculative decoding: look ahead over drafts, then roll back ------------------------
    def valid_prefix(self, drafts: list[int]) -> int:
        """How many leading drafts the grammar allows in a row (stopping after one that
        completes it); the matcher is left as it was."""
        accepted = 0
        for token in drafts:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                break
            accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        return accepted

    def fill_bitmasks(self, bitmask: torch.Tensor, first_row: int, drafts: list[int]) -> None:
        """The mask at the next position and after each draft (rows first_row..first_row +
        len(drafts)); the drafts must be a ``valid_prefix``. The matcher is left as it was."""
        self.fill_bitmask(bitmask, first_row)
        for j, token in enumerate(drafts):
            self.matcher.accept_token(token)
            if not self.matcher.is_terminated():  # (after the last token, a row nothing samples from)
                self.fill_bitmask(bitmask, first_row + j + 1)
        if drafts:
            self.matcher.rollback(len(drafts))


class StructuredOutputManager:
    """Compiles constraints for one tokenizer and model vocabulary."""

    def __init__(self, tokenizer_dir: Path, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        hf_tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(tokenizer_dir) / "tokenizer.json"))
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None)
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagoda-grammar")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0

    def grammar_for(self, params: StructuredOutputsParams) -> GrammarState:
        key = constraint_key(params)
        with self._lock:
            future = self._cache.get(key)
            if future is None or (future.done() and future.exception() is not None):
                future = self._executor.submit(self._compile, params)
                self._cache[key] = future
                if len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        return GrammarState(future)

    def _compile(self, params: StructuredOutputsParams):
        compiled = self.compiler.compile_grammar(build_grammar(params))
        self.num_compiled += 1
        return compiled

    @staticmethod
    def wait_any(states: list[GrammarState], timeout: float) -> None:
        """Block until one of these grammars is compiled (or timeout): the idle engine loop's wait."""
        wait([s._future for s in states], timeout=timeout, return_when=FIRST_COMPLETED)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def build_token_bitmask(states: list[GrammarState], vocab_size: int,
                        drafts: list[list[int]] | None = None) -> tuple[torch.Tensor, list[int]]:
    """xgrammar's packed allowed-token bitmask, int32 [rows, ceil(V / 32)]: for ``states[i]`` one
    row, or with ``drafts[i]`` (speculative decoding) one per position of the run, consecutive.
    Returns the bitmask and each state's first row."""
    import xgrammar as xgr

    drafts = drafts or [[] for _ in states]
    firsts = [0]
    for d in drafts[:-1]:
        firsts.append(firsts[-1] + len(d) + 1)
    bitmask = xgr.allocate_token_bitmask(firsts[-1] + len(drafts[-1]) + 1 if states else 0, vocab_size)
    for state, first, d in zip(states, firsts, drafts):
        state.fill_bitmasks(bitmask, first, d)
    return bitmask, firsts


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set every disallowed logit of the given rows to -inf, in place."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)
