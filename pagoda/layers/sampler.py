"""Token sampling, vectorized over the batch.

Order (as vLLM): logit bias and min_tokens masks, the structured-output token mask, repetition / presence / frequency penalties,
then greedy rows take the argmax; random rows divide by temperature, apply top-k, top-p and
min-p, and draw with the exponential trick argmax(p / q), q ~ Exp(1). A request with a seed
draws its q from its own generator, so its tokens do not depend on the rest of the batch.
Logprobs are those of the model's raw distribution (before any of the above).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagoda.layers.backend import TorchBackend

_NEG_INF = float("-inf")


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [N] float; 0 for greedy rows
    greedy: torch.Tensor  # [N] bool
    all_greedy: bool
    top_k: torch.Tensor | None  # [N] long; vocab size where off. None when no row uses it
    top_p: torch.Tensor | None  # [N] float; 1.0 where off
    min_p: torch.Tensor | None  # [N] float; 0.0 where off
    generators: dict[int, torch.Generator]  # row → per-request generator (seeded requests)
    # Penalties (None when no row uses them)
    presence: torch.Tensor | None = None  # [N]
    frequency: torch.Tensor | None = None  # [N]
    repetition: torch.Tensor | None = None  # [N]
    output_tokens: torch.Tensor | None = None  # [N, max_out] long, padded with -1
    prompt_tokens: torch.Tensor | None = None  # [N, max_prompt] long, padded with -1
    # Sparse additions: (row, token) pairs
    bias_rows: torch.Tensor | None = None
    bias_tokens: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    banned_rows: torch.Tensor | None = None  # min_tokens: eos / stop ids are banned until reached
    banned_tokens: torch.Tensor | None = None
    max_num_logprobs: int | None = None  # top-k logprobs to return (None: no logprobs)
    # Structured outputs: allowed tokens as a packed bitmask [N, ceil(V / 32)] int32 (token t is bit
    # t % 32 of word t // 32), applied to these rows only (the constrained requests of the batch).
    token_bitmask: torch.Tensor | None = None
    bitmask_rows: list[int] | None = None


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] long
    logprob_token_ids: torch.Tensor | None = None  # [N, 1 + k]: sampled token, then the top k
    logprobs: torch.Tensor | None = None  # [N, 1 + k]
    sampled_ranks: torch.Tensor | None = None  # [N] rank of the sampled token (1 = most likely)


class Sampler:
    def __init__(self, generator: torch.Generator | None = None,
                 argmax_rows: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.generator = generator
        self.argmax_rows = argmax_rows or TorchBackend.argmax_rows  # the model's backend's, where it has one

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if md.max_num_logprobs is not None else None
        logits = self._apply_masks_and_bias(logits, md)
        logits = apply_penalties(logits, md)
        greedy_tokens = self.argmax_rows(logits)
        if md.all_greedy:
            tokens = greedy_tokens
        else:
            tokens = torch.where(md.greedy, greedy_tokens, self._sample_random(logits, md))
        out = SamplerOutput(token_ids=tokens)
        if raw_logprobs is not None:
            self._gather_logprobs(raw_logprobs, tokens, md.max_num_logprobs, out)
        return out

    @staticmethod
    def _apply_masks_and_bias(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        if md.bias_rows is not None:
            logits = logits.index_put((md.bias_rows, md.bias_tokens), md.bias_values, accumulate=True)
        if md.banned_rows is not None:
            logits = logits.index_put((md.banned_rows, md.banned_tokens), torch.tensor(_NEG_INF))
        if md.token_bitmask is not None:
            from pagoda.structured_output import apply_token_bitmask  # deferred: loads llguidance

            logits = logits.clone()  # the caller's tensor stays as it was
            apply_token_bitmask(logits, md.token_bitmask, md.bitmask_rows)
        return logits

    def _sample_random(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        probs = sampling_probabilities(logits, md)
        q = torch.empty_like(probs)
        q.exponential_(generator=self.generator)
        for row, gen in md.generators.items():
            q[row].exponential_(generator=gen)
        return (probs / q).argmax(dim=-1)

    def processed_logits(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The logits the tokens are drawn from: bias, masks and penalties applied."""
        return apply_penalties(self._apply_masks_and_bias(logits.float(), md), md)

    @staticmethod
    def _gather_logprobs(raw: torch.Tensor, tokens: torch.Tensor, k: int, out: SamplerOutput) -> None:
        chosen = raw.gather(1, tokens.unsqueeze(1))
        out.sampled_ranks = (raw > chosen).sum(dim=-1) + 1
        if k > 0:
            top_lp, top_ids = raw.topk(k, dim=-1)
            out.logprobs = torch.cat([chosen, top_lp], dim=1)
            out.logprob_token_ids = torch.cat([tokens.unsqueeze(1), top_ids], dim=1)
        else:
            out.logprobs, out.logprob_token_ids = chosen, tokens.unsqueeze(1)


def sampling_probabilities(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Each random row's distribution after temperature, top-k, top-p and min-p (rows sum to 1
    but for min-p's cut; greedy rows at temperature 1)."""
    temperature = torch.where(md.greedy, torch.ones_like(md.temperature), md.temperature)
    logits = logits / temperature.unsqueeze(1)
    logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
    probs = torch.softmax(logits, dim=-1)
    if md.min_p is not None:
        threshold = probs.amax(dim=-1, keepdim=True) * md.min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _token_mask(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, L] padded (-1) token ids → [N, V] counts."""
    counts = torch.zeros(tokens.shape[0], vocab + 1, dtype=torch.float32)
    idx = torch.where(tokens < 0, vocab, tokens)
    counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float32))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    if md.output_tokens is None:
        return logits
    vocab = logits.shape[1]
    out_counts = _token_mask(md.output_tokens, vocab)
    if md.repetition is not None:
        seen = (out_counts > 0) | (_token_mask(md.prompt_tokens, vocab) > 0)
        rep = md.repetition.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
    if md.frequency is not None:
        logits = logits - md.frequency.unsqueeze(1) * out_counts
    if md.presence is not None:
        logits = logits - md.presence.unsqueeze(1) * (out_counts > 0).float()
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask everything outside each row's top-k, then outside its top-p nucleus, to -inf."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        ranks = torch.arange(logits.shape[1]).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), _NEG_INF)
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
        outside = before > top_p.unsqueeze(1)
        outside[:, 0] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(outside, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
