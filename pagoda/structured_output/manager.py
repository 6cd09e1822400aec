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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import llguidance
import torch

from pagoda.structured_output.grammar import LIMITS, build_grammar, constraint_key

if TYPE_CHECKING:
    from pagoda.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_CACHE_SIZE = 256


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar compiled against a tokenizer: a matcher at the start, which each request
    copies (a copy costs about a microsecond), and the tokens that end a completed grammar."""

    matcher: llguidance.LLMatcher
    stop_token_ids: frozenset[int]


def compile_grammar(tokenizer: llguidance.LLTokenizer, params: StructuredOutputsParams) -> CompiledGrammar:
    """Build the matcher (llguidance drops the GIL while it builds the lexer). Raises ValueError
    naming the field on bad input."""
    matcher = llguidance.LLMatcher(tokenizer, build_grammar(params), log_level=0, limits=LIMITS)
    if matcher.is_error():
        raise ValueError(f"structured_outputs.{params.kind} is invalid: {matcher.get_error()}")
    return CompiledGrammar(matcher, frozenset(tokenizer.eos_tokens))


def load_tokenizer(tokenizer_dir: Path, vocab_size: int, stop_token_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance's token trie of tokenizer.json, sized to the model's vocabulary (its logits'
    width); the stop tokens are the ones a completed grammar allows."""
    text = (Path(tokenizer_dir) / "tokenizer.json").read_text(encoding="utf-8")
    return llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=list(stop_token_ids) or None)


class GrammarState:
    """One request's view of its constraint: the compiled grammar (once ready) and its matcher.

    Stop tokens never reach the llguidance matcher (it counts one it takes while the grammar
    can still grow, but not one after it has stopped, so rollbacks would miscount): a stop
    token is accepted here when the grammar is complete, and ends it."""

    def __init__(self, future: Future) -> None:
        self._future = future
        self._matcher: llguidance.LLMatcher | None = None
        self._terminated = False
        self._logged_error = False

    def is_ready(self) -> bool:
        return self._future.done()

    @property
    def error(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None

    @property
    def matcher(self) -> llguidance.LLMatcher:
        if self._matcher is None:
            self._matcher = self._future.result().matcher.deep_copy()
        return self._matcher

    @property
    def _stop_ids(self) -> frozenset[int]:
        return self._future.result().stop_token_ids

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """The allowed tokens at the matcher's position into ``bitmask[row]``. A matcher in an
        error state (a step past the LIMITS) allows only the stop tokens, so its request ends."""
        target = bitmask[row]
        assert bitmask.dtype == torch.int32 and bitmask.device.type == "cpu" and target.is_contiguous()
        self.matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())
        if self.matcher.is_error() and not self._logged_error:
            self._logged_error = True
            logger.warning("grammar matcher stopped: %s", self.matcher.get_error())

    def accept(self, token_id: int) -> bool:
        """Advance the matcher; False when the token breaks the grammar (it was masked, so only
        a token forced past the mask, e.g. by min_tokens, can do that)."""
        if self._terminated:
            return False
        if token_id in self._stop_ids:
            self._terminated = self.matcher.is_accepting()
            return self._terminated
        return self.matcher.consume_token(token_id)

    def is_terminated(self) -> bool:
        """True once a stop token was accepted after the grammar was complete."""
        return self._terminated

    # -- speculative decoding: look ahead over drafts, then roll back ------------------------
    def valid_prefix(self, drafts: list[int]) -> int:
        """How many leading drafts the grammar allows in a row (stopping after one that
        completes it); the matcher is left as it was."""
        if self._terminated:
            return 0
        stop = next((i for i, t in enumerate(drafts) if t in self._stop_ids), len(drafts))
        head = drafts[:stop]
        accepted = self.matcher.validate_tokens(head)
        if accepted == len(head) < len(drafts) and self._accepting_after(head):
            accepted += 1  # the stop token that ends the grammar
        return accepted

    def _accepting_after(self, tokens: list[int]) -> bool:
        self.matcher.consume_tokens(tokens)
        accepting = self.matcher.is_accepting()
        if tokens:
            self.matcher.rollback(len(tokens))
        return accepting

    def fill_bitmasks(self, bitmask: torch.Tensor, first_row: int, drafts: list[int]) -> None:
        """The mask at the next position and after each draft (rows first_row..first_row +
        len(drafts)); the drafts must be a ``valid_prefix``. The matcher is left as it was."""
        self.fill_bitmask(bitmask, first_row)
        consumed = 0
        for j, token in enumerate(drafts):
            if token in self._stop_ids:  # it completes the grammar: no row after it is sampled from
                break
            self.matcher.consume_token(token)
            consumed += 1
            self.fill_bitmask(bitmask, first_row + j + 1)
        if consumed:
            self.matcher.rollback(consumed)


class StructuredOutputManager:
    """Compiles constraints for one tokenizer and model vocabulary."""

    def __init__(self, tokenizer_dir: Path, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagoda-grammar")
        # The token trie is built on the worker thread too (before any compilation, the pool
        # having one thread), so the first constrained request does not stall the engine loop.
        self._tokenizer = self._executor.submit(load_tokenizer, tokenizer_dir, vocab_size, stop_token_ids)
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

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        compiled = compile_grammar(self._tokenizer.result(), params)
        self.num_compiled += 1
        return compiled

    @staticmethod
    def wait_any(states: list[GrammarState], timeout: float) -> None:
        """Block until one of these grammars is compiled (or timeout): the idle engine loop's wait."""
        wait([s._future for s in states], timeout=timeout, return_when=FIRST_COMPLETED)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def allocate_token_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A packed allowed-token bitmask, int32 [rows, ceil(V / 32)], every token allowed: bit t % 32
    of word t // 32 is token t (llguidance's layout)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def build_token_bitmask(states: list[GrammarState], vocab_size: int,
                        drafts: list[list[int]] | None = None) -> tuple[torch.Tensor, list[int]]:
    """The packed allowed-token bitmask, int32 [rows, ceil(V / 32)]: for ``states[i]`` one
    row, or with ``drafts[i]`` (speculative decoding) one per position of the run, consecutive.
    Returns the bitmask and each state's first row."""
    drafts = drafts or [[] for _ in states]
    firsts = [0]
    for d in drafts[:-1]:
        firsts.append(firsts[-1] + len(d) + 1)
    bitmask = allocate_token_bitmask(firsts[-1] + len(drafts[-1]) + 1 if states else 0, vocab_size)
    for state, first, d in zip(states, firsts, drafts):
        state.fill_bitmasks(bitmask, first, d)
    return bitmask, firsts


# A byte of the mask → its 8 tokens' logit penalties: 0 where bit i (token i) is set, else -inf.
_BYTE_PENALTY = torch.where(((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool(), 0.0, float("-inf"))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set every disallowed logit of the given rows to -inf, in place. Plain torch (llguidance's
    own helper is torch.compile'd: a C++ compiler on CPU, triton on GPU): the mask's bytes look
    up their tokens' penalties (one gather), which are added to the logits (one pass)."""
    index = torch.tensor(rows, dtype=torch.long)
    # The int32 words as bytes, little-endian as on every platform torch ships for: token t is
    # bit t % 8 of byte t // 8.
    packed = bitmask.index_select(0, index).view(torch.uint8).flatten().to(logits.device, torch.int32)
    penalty = _BYTE_PENALTY.to(logits.device, logits.dtype).index_select(0, packed).view(len(rows), -1)
    vocab = logits.shape[1]
    if penalty.shape[1] < vocab:  # tokens past the mask are never allowed
        penalty = torch.cat([penalty, penalty.new_full((len(rows), vocab - penalty.shape[1]), float("-inf"))], dim=1)
    logits.index_add_(0, index.to(logits.device), penalty[:, :vocab])
