"""Turns a SchedulerOutput into batch tensors, runs the model and samples.

The batch is flat (no padding of prompts): decode tokens first, then prefill chunks. Logits are
computed only where they are needed: the last token of each request that samples this step,
and the prompt positions of requests that asked for prompt logprobs.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch

from pagoda.core.scheduler import SchedulerOutput
from pagoda.forward_context import AttentionMetadata, PrefillSeq, set_attention_metadata
from pagoda.layers.cpu_kernels import batch_invariant, load_cpu_kernels
from pagoda.layers.sampler import Sampler, SamplingMetadata
from pagoda.request import Request
from pagoda.structured_output.manager import build_token_bitmask
from pagoda.worker.compiled import compiled_forward

logger = logging.getLogger(__name__)


@dataclass
class TokenLogprobs:
    """Logprobs at one position: the chosen token first, then the top-k alternatives."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int  # rank of the chosen token


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int,
                 device: torch.device, generator: torch.Generator | None = None, compile: bool = False,
                 deterministic: bool | None = None) -> None:
        """``deterministic`` (default: what the model was loaded with, EngineConfig.deterministic):
        batch-invariant inference, see ``_is_decode_like`` and ``execute``."""
        self.model = model
        if deterministic is None:
            deterministic = bool(getattr(model, "deterministic", False))
        # Batch invariance takes pagoda's CPU kernels (the paged kernel for every row, the
        # invariant GEMM); without them (CUDA, no compiler) the layout stays as it is.
        self.deterministic = deterministic and device.type == "cpu" and load_cpu_kernels() is not None
        if deterministic and not self.deterministic:
            logger.warning("deterministic inference needs pagoda's CPU kernels: not available here, so results "
                           "may depend on the batch and on prefix caching")
        # the kernels' batch-invariant switch, set for each step (another engine may share the process)
        self._invariance = (
            (lambda: batch_invariant(self.deterministic)) if device.type == "cpu" else contextlib.nullcontext
        )
        self.forward = compiled_forward(model) if compile else model.forward
        self.block_size = block_size
        self.device = device
        self.vocab_size = model.config.vocab_size
        self.sampler = Sampler(generator)
        for i, attn in enumerate(model.attention_layers()):
            attn.bind_kv_cache(kv_cache[0, i], kv_cache[1, i])

    # -- batch layout -----------------------------------------------------------------------
    # A short chunk over a cached prefix (a prefix-cache hit's remaining prompt tokens, the tail
    # of a chunked prompt) runs as one decode row per token: row j attends to the first
    # start + j + 1 positions, read in place by the paged kernel instead of gathering the prefix.
    # Under deterministic inference every chunk runs so, whatever its length or prefix: a token's
    # attention is then computed the same way whether it is a decode, in a fresh prompt, after a
    # cache hit or in any chunk (the paged kernel tiles a chunk's rows without changing a row's
    # sums), and a batch of decode-like rows only runs as one C++ call (models/decode_stack.py).
    SHORT_CHUNK = 32

    def _is_decode_like(self, request: Request, n: int) -> bool:
        return self.deterministic or n == 1 or (request.num_computed_tokens > 0 and n <= self.SHORT_CHUNK)

    def _layout(self, sched: SchedulerOutput) -> list[tuple[Request, int]]:
        decodes = [(r, n) for r, n in sched.scheduled if self._is_decode_like(r, n)]
        prefills = [(r, n) for r, n in sched.scheduled if not self._is_decode_like(r, n)]
        return decodes + prefills

    def _slots(self, request: Request, start: int, n: int) -> list[int]:
        bs, blocks = self.block_size, request.block_ids
        return [blocks[p // bs] * bs + p % bs for p in range(start, start + n)]

    def _prepare(self, batch: list[tuple[Request, int]]):
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillSeq] = []
        num_decodes = 0
        decode_entries = []
        for request, n in batch:
            start = request.num_computed_tokens
            if self._is_decode_like(request, n):
                num_decodes += n
                decode_entries.append((request, n))
            else:
                table = torch.tensor(request.block_ids, dtype=torch.long, device=self.device)
                prefills.append(PrefillSeq(len(input_ids), n, start, table))
            input_ids.extend(request.all_token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(self._slots(request, start, n))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device), num_decodes=num_decodes,
            prefills=prefills, block_size=self.block_size,
        )
        if num_decodes:
            self._decode_metadata(decode_entries, meta)
        return torch.tensor(input_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), meta

    def _decode_metadata(self, decodes: list[tuple[Request, int]], meta: AttentionMetadata) -> None:
        """One row per decode token: its request's block table and how many positions it sees."""
        rows = sum(n for _, n in decodes)
        max_blocks = max(len(r.block_ids) for r, _ in decodes)
        tables = torch.zeros(rows, max_blocks, dtype=torch.long)
        lengths = torch.empty(rows, dtype=torch.long)
        i = 0
        for r, n in decodes:
            tables[i : i + n, : len(r.block_ids)] = torch.tensor(r.block_ids, dtype=torch.long)
            start = r.num_computed_tokens
            lengths[i : i + n] = torch.arange(start + 1, start + n + 1)
            i += n
        meta.decode_block_tables = tables.to(self.device)
        meta.decode_seq_lens = lengths.to(self.device)

    # -- run --------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        batch = self._layout(sched)
        input_ids, positions, meta = self._prepare(batch)
        sample_rows, sample_reqs, prompt_rows = self._logit_rows(batch)
        out = RunnerOutput()
        with self._invariance():  # the kernels' batch-invariant mode, for this engine's steps
            with set_attention_metadata(meta):
                hidden = self.forward(input_ids.to(self.device), positions.to(self.device))
            if sample_rows:
                logits = self.model.compute_logits(hidden[sample_rows]).float().cpu()
                self._sample(logits, sample_reqs, out)
            for request, rows, targets in prompt_rows:
                logits = self.model.compute_logits(hidden[rows]).float().cpu()
                out.prompt_logprobs[request.request_id] = _prompt_logprobs(logits, targets, request.sampling_params.prompt_logprobs)
        return out

    def _logit_rows(self, batch):
        """Which flat rows need logits: the last token of every request that completes its
        tokens this step (it samples), and prompt positions for prompt logprobs."""
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        prompt_rows = []
        offset = 0
        for request, n in batch:
            start = request.num_computed_tokens
            if start + n == request.num_tokens:
                sample_rows.append(offset + n - 1)
                sample_reqs.append(request)
            if request.sampling_params.prompt_logprobs is not None:
                begin = max(start, request.num_prompt_logprobs_done)
                end = min(start + n, request.num_prompt_tokens - 1)
                if end > begin:
                    rows = list(range(offset + begin - start, offset + end - start))
                    targets = request.prompt_token_ids[begin + 1 : end + 1]
                    prompt_rows.append((request, rows, targets))
                    request.num_prompt_logprobs_done = end
            offset += n
        return sample_rows, sample_reqs, prompt_rows

    def _sample(self, logits: torch.Tensor, requests: list[Request], out: RunnerOutput) -> None:
        md = build_sampling_metadata(requests, self.vocab_size)
        result = self.sampler(logits, md)
        tokens = result.token_ids.tolist()
        for i, request in enumerate(requests):
            out.sampled[request.request_id] = tokens[i]
        if result.logprobs is not None:
            ids, lps, ranks = result.logprob_token_ids.tolist(), result.logprobs.tolist(), result.sampled_ranks.tolist()
            for i, request in enumerate(requests):
                k = request.sampling_params.logprobs
                if k is not None:
                    out.logprobs[request.request_id] = TokenLogprobs(ids[i][: 1 + k], lps[i][: 1 + k], ranks[i])


def _prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    lp = torch.log_softmax(logits, dim=-1)
    target = torch.tensor(targets, dtype=torch.long).unsqueeze(1)
    chosen = lp.gather(1, target)
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    top_lp, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], target[:, :0])
    ids = torch.cat([target, top_ids], dim=1).tolist()
    vals = torch.cat([chosen, top_lp], dim=1).tolist()
    return [TokenLogprobs(ids[i], vals[i], ranks[i]) for i in range(len(targets))]


def build_sampling_metadata(requests: list[Request], vocab_size: int) -> SamplingMetadata:
    params = [r.sampling_params for r in requests]
    n = len(requests)
    greedy = torch.tensor([p.greedy for p in params])
    md = SamplingMetadata(
        temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
        greedy=greedy,
        all_greedy=bool(greedy.all()),
        top_k=None, top_p=None, min_p=None,
        generators={i: r.generator for i, r in enumerate(requests) if r.generator is not None and not r.sampling_params.greedy},
    )
    if any(p.top_k > 0 for p in params):
        md.top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params], dtype=torch.long)
    if any(p.top_p < 1.0 for p in params):
        md.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    if any(p.min_p > 0.0 for p in params):
        md.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
    _add_penalties(md, requests)
    _add_sparse(md, requests, vocab_size)
    bitmask = build_token_bitmask(requests, vocab_size)
    if bitmask is not None:
        md.token_bitmask, md.bitmask_rows = bitmask
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    md.max_num_logprobs = max(wanted) if wanted else None
    return md


def _padded(rows: list[list[int]]) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    out = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def _add_penalties(md: SamplingMetadata, requests: list[Request]) -> None:
    params = [r.sampling_params for r in requests]
    if not any(p.needs_penalties for p in params):
        return
    md.output_tokens = _padded([r.output_token_ids for r in requests])
    if any(p.presence_penalty for p in params):
        md.presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)
    if any(p.frequency_penalty for p in params):
        md.frequency = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)
    if any(p.repetition_penalty != 1.0 for p in params):
        md.repetition = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)
        md.prompt_tokens = _padded([r.prompt_token_ids if r.sampling_params.repetition_penalty != 1.0 else [] for r in requests])


def _add_sparse(md: SamplingMetadata, requests: list[Request], vocab_size: int) -> None:
    bias = [(i, t, b) for i, r in enumerate(requests) for t, b in (r.sampling_params.logit_bias or {}).items() if t < vocab_size]
    if bias:
        rows, toks, vals = zip(*bias)
        md.bias_rows, md.bias_tokens = torch.tensor(rows), torch.tensor(toks)
        md.bias_values = torch.tensor(vals, dtype=torch.float32)
    banned = []
    for i, r in enumerate(requests):
        p = r.sampling_params
        if r.num_output_tokens < p.min_tokens:
            stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else p.all_stop_token_ids)
            banned += [(i, t) for t in stop_ids if t < vocab_size]
    if banned:
        rows, toks = zip(*banned)
        md.banned_rows, md.banned_tokens = torch.tensor(rows), torch.tensor(toks)
