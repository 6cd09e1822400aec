"""Beam search in the front end, as vLLM V1 runs it: no scheduler of its own, only one-token
generations.

Each step asks the engine, for every live beam, one token with the top `2 x beam_width` logprobs
(prompt = the beam's tokens; the prefix cache serves what earlier steps computed, so a step
computes little more than the new token). Every candidate (beam + token) scores its beam's
cumulative logprob plus the token's; one that ends in an end-of-sequence token is finished, the
others compete and the best `beam_width` live on. At the end, finished and live beams are ranked
by `cum_logprob / len ** length_penalty` (len: the prompt and the generated tokens, the
end-of-sequence token not counted, as vLLM's `get_beam_search_score`).

`BeamSearch` is one prompt's search, driven by `LLM.beam_search` (offline) or `beam_search_async`
(the server, on AsyncLLM); `final_output` turns its best beams into a RequestOutput for the server.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagoda.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagoda.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.engine.content_filter import Moderation
    from pagoda.tokenizer import Tokenizer


@dataclass
class BeamSearchSequence:
    """One beam, in vLLM's shape: `tokens` are the prompt's then the generated ones (an
    end-of-sequence token included); `text` is filled for the answer."""

    tokens: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)  # each step's candidates
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (end of sequence) or "length" once answered
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """One prompt's answer: its best beams, best first (vLLM's shape)."""

    sequences: list[BeamSearchSequence]


def step_params(params: BeamSearchParams) -> SamplingParams:
    """The one-token request of each live beam: greedy, with the 2 x beam_width top logprobs."""
    return SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * params.beam_width, ignore_eos=True,
                          speculative=False, output_kind=RequestOutputKind.FINAL_ONLY)


class BeamSearch:
    """One prompt's beams: `live` (each step's prompts), `advance` with the step's logprobs,
    `best` when `done`."""

    def __init__(self, prompt_ids: list[int], params: BeamSearchParams, eos_token_ids: set[int],
                 max_model_len: int) -> None:
        self.params = params
        self.prompt_ids = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.eos = set() if params.ignore_eos else set(eos_token_ids)
        # A beam can grow only while the context has room for the step's new token.
        self.steps_left = min(params.max_tokens, max_model_len - len(prompt_ids))
        self.live = [BeamSearchSequence(list(prompt_ids))]
        self.finished: list[BeamSearchSequence] = []

    @property
    def done(self) -> bool:
        stopped_early = self.params.early_stopping and len(self.finished) >= self.params.beam_width
        return self.steps_left <= 0 or not self.live or stopped_early

    def advance(self, positions: list[PositionLogprobs]) -> None:
        """One step: `positions[i]` holds live beam i's candidates (token id → Logprob)."""
        candidates = []
        for beam, position in zip(self.live, positions):
            for token, lp in position.items():
                ends = token in self.eos
                child = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [position],
                                           beam.cum_logprob + lp.logprob, finish_reason="stop" if ends else None,
                                           stop_reason=token if ends else None)
                (self.finished if ends else candidates).append(child)
        # All live candidates have one length, so the cumulative logprob alone ranks them (a
        # stable sort: ties keep the beams' order, then the logprobs' rank order).
        candidates.sort(key=lambda beam: beam.cum_logprob, reverse=True)
        self.live = candidates[: self.params.beam_width]
        self.steps_left -= 1

    def score(self, beam: BeamSearchSequence) -> float:
        length = len(beam.tokens) - (1 if beam.finish_reason == "stop" else 0)
        return beam.cum_logprob / (length ** self.params.length_penalty)

    def best(self) -> list[BeamSearchSequence]:
        """The answer, best first: the best beam_width of the finished and the live beams (with
        early_stopping, of the finished ones, once beam_width of them are)."""
        early = self.params.early_stopping and len(self.finished) >= self.params.beam_width
        pool = self.finished if early else self.finished + self.live
        ranked = sorted(pool, key=self.score, reverse=True)[: self.params.n or self.params.beam_width]
        for beam in ranked:
            beam.finish_reason = beam.finish_reason or "length"
        return ranked


def final_output(request_id: str, search: BeamSearch, tokenizer: Tokenizer, num_cached_tokens: int = 0,
                 moderation: Moderation | None = None) -> RequestOutput:
    """The server's answer: one finished RequestOutput whose outputs are the best beams, best
    first, each the generated part only (the end-of-sequence token dropped unless
    include_stop_str_in_output); `moderation` filters each text whole."""
    params = search.params
    outputs = []
    for index, beam in enumerate(search.best()):
        ids = beam.tokens[search.prompt_len:]
        if beam.finish_reason == "stop" and not params.include_stop_str_in_output:
            ids = ids[:-1]
        text = tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
        finish_reason = beam.finish_reason
        if moderation is not None:
            guard = moderation.guard()
            text = guard.feed(text, final=True)
            finish_reason = "content_filter" if guard.stopped else finish_reason
        outputs.append(CompletionOutput(index, text, ids, beam.cum_logprob, None, finish_reason, beam.stop_reason))
    return RequestOutput(request_id, None, search.prompt_ids, outputs, finished=True,
                         num_cached_tokens=num_cached_tokens)


async def beam_search_async(engine: AsyncLLM, prompt_ids: list[int], params: BeamSearchParams, request_id: str,
                            priority: int = 0, cache_salt: str | None = None,
                            moderation: Moderation | None = None) -> RequestOutput:
    """Run one prompt's beam search on the server's engine: each step's beams as concurrent
    one-token requests (cancelled with this coroutine, which aborts them)."""
    search = BeamSearch(prompt_ids, params, engine.tokenizer.eos_token_ids, engine.max_model_len)
    one_token = step_params(params)
    cached, step = None, 0
    while not search.done:
        runs = [_one_token(engine, beam.tokens, one_token, f"{request_id}-beam{step}-{i}", priority, cache_salt)
                for i, beam in enumerate(search.live)]
        outputs = await asyncio.gather(*runs)
        cached = outputs[0][1] if cached is None else cached  # the prompt's, from the first step
        search.advance([position for position, _ in outputs])
        step += 1
    return final_output(request_id, search, engine.tokenizer, cached or 0, moderation)


async def _one_token(engine: AsyncLLM, tokens: list[int], params: SamplingParams, request_id: str,
                     priority: int, cache_salt: str | None) -> tuple[PositionLogprobs, int]:
    """The step's candidates for one beam (its token's logprobs position) and the prompt tokens
    the prefix cache served."""
    positions: list[PositionLogprobs] = []
    cached = 0
    async for out in engine.generate({"prompt_token_ids": tokens}, params, request_id, priority, cache_salt):
        positions += out.outputs[0].logprobs or []  # deltas: the token's position comes once
        cached = out.num_cached_tokens
    return positions[0], cached
