"""Turns EngineCoreOutputs (token ids) into RequestOutputs (text, logprobs, finish reasons).

Owns incremental detokenization, stop strings (which the core cannot see: they are text) and
the fan-in of `n > 1` samples into one RequestOutput.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagoda.engine.core import EngineCoreOutput
from pagoda.engine.detokenizer import IncrementalDetokenizer
from pagoda.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput, TokenLogprobs
from pagoda.sampling_params import RequestOutputKind, SamplingParams
from pagoda.tokenizer import Tokenizer

# (compared by identity: an enum's == and class attribute lookups cost a Python call each, and
# _make_output runs for every request every step)
_DELTA, _FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


@dataclass
class SampleState:
    """One sequence being generated (one of the n samples of a request)."""

    core_id: str
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_text: int = 0  # DELTA mode: chars / tokens / logprob entries already handed out
    sent_tokens: int = 0
    sent_finish: bool = False
    # The content filter (pagoda/engine/content_filter.py), when the request has one: its guard,
    # how much of the text it has taken, and the text it let through (what is handed out).
    guard: Any = None
    guard_fed: int = 0
    safe_text: str = ""


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[SampleState]
    output_kind: RequestOutputKind
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        if len(self.samples) == 1:  # most requests: no generator for one sample
            return self.samples[0].finish_reason is not None
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self._by_core_id: dict[str, tuple[RequestState, SampleState]] = {}
        self._token_texts: dict[int, str] = {}  # token id → its text, for logprobs (at most the vocabulary)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    samples: list[tuple[str, SamplingParams]], arrival_time: float, moderation: Any = None) -> None:
        """`moderation` (a pagoda.engine.content_filter.Moderation) checks each sample's text as it
        is generated: held back, masked, or the sample stopped with finish_reason "content_filter"."""
        first = samples[0][1]
        state = RequestState(
            request_id, prompt, prompt_token_ids, [], first.output_kind, RequestMetrics(arrival_time),
            prompt_logprobs=[None] if first.prompt_logprobs is not None else None,
        )
        for index, (core_id, params) in enumerate(samples):
            sample = SampleState(
                core_id, index, params, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
                guard=moderation.guard() if moderation is not None else None,
            )
            state.samples.append(sample)
            self._by_core_id[core_id] = (state, sample)
        self.requests[request_id] = state

    def core_ids(self, request_id: str) -> list[str]:
        state = self.requests.get(request_id)
        return [s.core_id for s in state.samples] if state else []

    def abort_request(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state:
            for s in state.samples:
                self._by_core_id.pop(s.core_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- processing -------------------------------------------------------------------------
    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the RequestOutputs to hand out and the core ids to stop (stop strings hit)."""
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        to_stop: list[str] = []
        by_core_id = self._by_core_id.get  # (once: the loop runs for every request every step)
        for out in outputs:
            entry = by_core_id(out.request_id)
            if entry is None:
                continue  # aborted meanwhile
            state, sample = entry
            guard = sample.guard
            if guard is not None and guard.stopped:
                continue  # the content filter ended it; what the core still sent is dropped
            metrics = state.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = out.first_scheduled_time
                state.num_cached_tokens = out.num_cached_tokens
            if out.new_prompt_logprobs and state.prompt_logprobs is not None:
                state.prompt_logprobs += [self._position(lp) for lp in out.new_prompt_logprobs]
            if out.new_token_ids:
                if metrics.first_token_time is None:
                    metrics.first_token_time = now
                metrics.last_token_time = now
                if self._update_sample(sample, out):
                    to_stop.append(sample.core_id)
            if out.finish_reason is not None and sample.finish_reason is None:
                sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
                self._flush(sample)
            if guard is not None and self._moderate(sample) and out.finish_reason is None \
                    and sample.core_id not in to_stop:
                to_stop.append(sample.core_id)  # finished in the core too: its KV blocks are freed
            touched[state.request_id] = state
        results = []
        for state in touched.values():
            finished = state.finished
            if finished:
                state.metrics.finished_time = now
                self.abort_request(state.request_id)
            result = self._make_output(state, finished)
            if result is not None:
                results.append(result)
        return results, to_stop

    def _update_sample(self, sample: SampleState, out: EngineCoreOutput) -> bool:
        """Append tokens and text; True when a stop string ended the sample."""
        sample.token_ids += out.new_token_ids
        if out.new_logprobs and sample.logprobs is not None:
            for lp in out.new_logprobs:
                sample.logprobs.append(self._position(lp))
                sample.cumulative_logprob += lp.logprobs[0]
        tokens = out.new_token_ids
        if out.finish_reason == "stop" and not sample.params.include_stop_str_in_output \
                and _ended_by_stop_token(tokens[-1], out.stop_reason, sample.params):
            tokens = tokens[:-1]  # a stop token's text (EOS, stop_token_ids) is not output, as in vLLM
        delta = sample.detokenizer.step(tokens) if tokens else ""
        sample.text += delta
        if not sample.params.stop or not delta:
            return False
        stop = _find_stop(sample.text, len(delta), sample.params)
        if stop is None:
            return False
        stop_str, cut = stop
        sample.text = sample.text[:cut]
        sample.finish_reason, sample.stop_reason = "stop", stop_str
        return True

    @staticmethod
    def _flush(sample: SampleState) -> None:
        """The core finished the sample: emit text still held back, stop strings still apply."""
        tail = sample.detokenizer.flush()
        if not tail:
            return
        sample.text += tail
        stop = _find_stop(sample.text, len(tail), sample.params) if sample.params.stop else None
        if stop is not None:
            sample.text = sample.text[: stop[1]]
            sample.finish_reason, sample.stop_reason = "stop", stop[0]

    @staticmethod
    def _moderate(sample: SampleState) -> bool:
        """Give the content filter the sample's new text (what stop strings let through); True
        when it stopped the sample now."""
        visible = _stop_checked(sample)
        new, final = visible[sample.guard_fed :], sample.finish_reason is not None
        if not new and not final:
            return False
        sample.guard_fed = len(visible)
        sample.safe_text += sample.guard.feed(new, final)
        if not sample.guard.stopped:
            return False
        sample.finish_reason, sample.stop_reason = "content_filter", None
        return True

    def _position(self, lp: TokenLogprobs) -> PositionLogprobs:
        """Chosen token first (with its true rank), then the top-k alternatives ranked 1..k."""
        position: PositionLogprobs = {}
        for i, (tid, value) in enumerate(zip(lp.token_ids, lp.logprobs)):
            if tid not in position:
                rank = lp.rank if i == 0 else i
                position[tid] = Logprob(value, rank, self._token_text(tid))
        return position

    def _token_text(self, tid: int) -> str:
        """One token's text (special tokens kept), decoded once: logprobs ask for k + 1 tokens
        a position, and a tokenizer call costs more than the rest of the position's work."""
        text = self._token_texts.get(tid)
        if text is None:
            text = self._token_texts[tid] = self.tokenizer.decode([tid], skip_special_tokens=False)
        return text

    def _make_output(self, state: RequestState, finished: bool) -> RequestOutput | None:
        kind = state.output_kind
        if kind is _FINAL_ONLY and not finished:
            return None
        delta = kind is _DELTA
        completions = []
        for s in state.samples:
            if delta:
                text = _visible(s)[s.sent_text :]
                tokens = s.token_ids[s.sent_tokens :]
                logprobs = s.logprobs[s.sent_tokens :] if s.logprobs is not None else None
                if not text and not tokens and (s.finish_reason is None or s.sent_finish):
                    continue
                s.sent_text += len(text)
                s.sent_tokens += len(tokens)
                s.sent_finish = s.finish_reason is not None
            else:
                text, tokens, logprobs = _visible(s), list(s.token_ids), s.logprobs
            completions.append(CompletionOutput(
                s.index, text, tokens, s.cumulative_logprob, logprobs, s.finish_reason, s.stop_reason,
            ))
        prompt_logprobs = state.prompt_logprobs
        if delta:
            if state.prompt_logprobs_sent:
                prompt_logprobs = None
            state.prompt_logprobs_sent = True
        return RequestOutput(
            state.request_id, state.prompt, state.prompt_token_ids, completions, finished,
            prompt_logprobs, state.num_cached_tokens, state.metrics,
        )


def _visible(sample: SampleState) -> str:
    """Text safe to hand out: what the content filter let through, if the request has one."""
    return sample.safe_text if sample.guard is not None else _stop_checked(sample)


def _stop_checked(sample: SampleState) -> str:
    """The text while running, less a tail that could start a stop string."""
    if sample.finish_reason is not None or not sample.params.stop:
        return sample.text
    hold = max(len(s) for s in sample.params.stop) - 1
    return sample.text[: len(sample.text) - hold] if hold > 0 else sample.text


def _find_stop(text: str, new_chars: int, params: SamplingParams) -> tuple[str, int] | None:
    """Earliest stop string that ends in the new text → (stop string, where to cut the text)."""
    best: tuple[str, int] | None = None  # (stop string, position)
    for stop in params.stop:
        pos = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if pos != -1 and (best is None or pos < best[1]):
            best = (stop, pos)
    if best is None:
        return None
    stop, pos = best
    return stop, pos + len(stop) if params.include_stop_str_in_output else pos


def _ended_by_stop_token(token: int, stop_reason: int | str | None, params: SamplingParams) -> bool:
    """Whether the core stopped the sample on `token` as a stop token: one of stop_token_ids (its
    id is the reason), or end of sequence (no reason; a grammar that completed has none either,
    but its last token is then no EOS)."""
    if stop_reason is not None:
        return token == stop_reason
    return not params.ignore_eos and token in params.all_stop_token_ids
