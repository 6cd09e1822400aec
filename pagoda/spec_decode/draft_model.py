"""Draft-model proposals: a smaller or quantized model that shares the target's tokenizer guesses
the next k tokens greedily, and the target verifies them in one pass (model_runner._verify).

The draft keeps its own paged KV cache, indexed by the target's block tables: block b of the
draft cache holds the draft's K/V for the same tokens as block b of the target's. The draft
never runs with the target; it catches up when it proposes. So the proposer keeps, per request,
how many leading positions of its cache hold the draft's K/V for the request's real tokens
(``computed``), and per block whether the draft filled it completely (``filled``), which is
what makes a prefix-cache hit a hit for the draft too. A block the scheduler hands out afresh
(a new allocation, or one reused after eviction) is not filled until the draft writes all of it.

A request whose drafts the target keeps rejecting gets fewer, or none (``adaptive``): the j-th
draft of a run pays off when the chance that it and all before it are accepted, alpha^j, is at
least what it costs, a draft pass over a target decode step (both medians of recent times
measured as the engine runs, and the cost never under ``MIN_COST``; alpha from the request's own
verifications, a decaying count of accepted drafts and of rejections, which starts at one
accepted draft: that prior decays too, so a request whose drafts are always rejected sees alpha
fall towards zero and stops drafting whatever the cost).
A request drafting nothing tries one draft every ``PROBE_EVERY`` steps to measure again.

Each proposal runs k forward passes of the draft: the first over every token the draft has not
seen (usually the target's last token, after an accepted run also the run's last draft; a
whole prompt for a request that just finished its prefill), then one row per request per
further token. The draft writes K/V at the positions after the request's tokens; the scheduler
allocates those slots ahead (``Scheduler.spec_lookahead``), and a request without them gets fewer
drafts. Drafts are greedy: verification treats a draft as a point mass (``accept_by_rejection``),
which is exact whatever chose it.
"""

from __future__ import annotations

import statistics
import time
from collections import deque

import numpy as np
import torch

from pagoda.core.scheduler_output import SchedulerOutput
from pagoda.forward_context import set_attention_metadata
from pagoda.worker.batch_layout import BatchLayout, decode_like_rows, prepare_inputs
from pagoda.worker.input_batch import InputBatch

# A catch-up chunk of at most this many tokens over the draft's cached prefix runs as decode rows.
SHORT_CHUNK = 32
PROBE_EVERY = 16  # steps a request drafting nothing waits before it tries one draft again
DECAY = 0.8  # weight of the past in a request's acceptance counts (recent verifications count most)
# The least a draft is taken to cost, as a share of a target step, whatever the timings say: its
# verification row and bookkeeping are not free, and a pass timed as nearly free (a tiny draft, or a
# target step slowed by a busy host) must not keep a request with hopeless drafts drafting.
MIN_COST = 0.15
TIMING_WINDOW = 9  # the draft-pass and target-step times are medians of this many recent measurements


class DraftModelProposer:
    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, batch: InputBatch, block_size: int,
                 device: torch.device, num_speculative_tokens: int, adaptive: bool = True) -> None:
        self.model = model
        self.backend = model.backend
        self.batch = batch
        self.block_size = block_size
        self.device = device
        self.k = num_speculative_tokens
        for i, attn in enumerate(model.attention_layers()):
            attn.bind_kv_cache(kv_cache[0, i], kv_cache[1, i])
        self.filled = np.zeros(kv_cache.shape[2], dtype=bool)  # block → holds the draft's K/V for all its tokens
        self.computed: dict[str, int] = {}  # request → leading positions the draft has computed
        self.proposed: dict[str, tuple[int, list[int]]] = {}  # request → (position of its drafts, drafts)
        self.num_tokens_run = 0  # tokens the draft has computed (a prefix-cache hit saves some)
        self.adaptive = adaptive
        self.acceptance: dict[str, list[float]] = {}  # request → [accepted drafts, rejections], decaying
        self.idle_steps: dict[str, int] = {}  # request → steps it has drafted nothing
        # the median time of one draft pass and of one target decode step, over recent ones: a
        # median, because one slow step (the first, a page fault, a busy host) must not make
        # drafts look cheap or dear for long
        self._pass_times: deque[float] = deque(maxlen=TIMING_WINDOW)
        self._step_times: deque[float] = deque(maxlen=TIMING_WINDOW)
        self.pass_seconds = 0.0
        self.step_seconds = 0.0

    # -- how many drafts a request gets -----------------------------------------------------
    def record_verification(self, rid: str, num_drafts: int, num_accepted: int) -> None:
        """The target verified ``num_drafts`` of the request's drafts and accepted the first
        ``num_accepted``: successes, and one failure unless all held."""
        counts = self.acceptance.setdefault(rid, [1.0, 0.0])  # the prior: one accepted draft
        counts[0] = DECAY * counts[0] + num_accepted
        counts[1] = DECAY * counts[1] + (num_accepted < num_drafts)

    def record_step(self, seconds: float) -> None:
        """The target's last decode step took ``seconds`` (the unit a draft's cost is measured
        in; a step with prefill rows is not one: it would make drafts look cheap)."""
        self._step_times.append(seconds)
        self.step_seconds = statistics.median(self._step_times)

    def draft_length(self, rid: str) -> int:
        """Drafts worth proposing for the request: the j-th while alpha^j >= draft pass / target
        step (alpha: accepted / (accepted + rejections), both decaying from one accepted draft)."""
        if not self.adaptive or not self.step_seconds:
            return self.k
        accepted, rejected = self.acceptance.get(rid, (1.0, 0.0))
        alpha = accepted / (accepted + rejected)
        cost = max(MIN_COST, self.pass_seconds / self.step_seconds)
        length = 0
        while length < self.k and alpha ** (length + 1) >= cost:
            length += 1
        if length:
            self.idle_steps.pop(rid, None)
            return length
        idle = self.idle_steps.get(rid, 0) + 1
        self.idle_steps[rid] = 0 if idle >= PROBE_EVERY else idle
        return 1 if idle >= PROBE_EVERY else 0

    # -- following the scheduler's blocks ---------------------------------------------------
    def observe(self, sched: SchedulerOutput) -> None:
        """Forget finished requests; mark blocks handed out afresh as not filled. A new request's
        blocks below its computed tokens are prefix-cache hits: their content (and the draft's,
        where filled) is kept; the same for a request resumed after preemption, which also starts
        over in the draft."""
        for rid in sched.finished_req_ids:
            self.computed.pop(rid, None)
            self.proposed.pop(rid, None)
            self.acceptance.pop(rid, None)
            self.idle_steps.pop(rid, None)
        for new in sched.new_requests:
            self.computed.pop(new.req_id, None)
            self.proposed.pop(new.req_id, None)
            self.filled[new.block_ids[new.num_computed_tokens // self.block_size :]] = False
        for cached in sched.cached_requests:
            if cached.resumed_from_preemption:
                self.computed.pop(cached.req_id, None)
                self.proposed.pop(cached.req_id, None)
                self.filled[cached.new_block_ids[cached.num_computed_tokens // self.block_size :]] = False
            else:
                self.filled[cached.new_block_ids] = False

    # -- proposing --------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, new_tokens: dict[str, list[int]]) -> dict[str, list[int]]:
        """Up to k drafts for each request in ``new_tokens`` (request → the tokens the target
        just produced for it, not yet in the batch's rows)."""
        b, bs = self.batch, self.block_size
        req_ids, starts, ends, ks = [], [], [], []
        for rid, tokens in new_tokens.items():
            row = b.index[rid]
            n = int(b.num_tokens[row])
            if n == b.num_prompt[row]:
                continue  # its first token: the draft's catch-up over the prompt waits a step, off the TTFT
            end = n + len(tokens)  # the request's length with the new tokens
            # the positions the draft may write: allocated, and inside the context
            room = min(int(b.num_blocks[row]) * bs, b.max_model_len)
            k = min(self.draft_length(rid), room - end + 1, b.max_model_len - end)
            if k < 1:
                continue
            b.token_ids[row, n:end] = tokens  # inputs for now; the next message brings the same tokens
            req_ids.append(rid)
            starts.append(self._valid_prefix(rid, row, end))
            ends.append(end)
            ks.append(k)
        if not req_ids:
            return {}
        return self._run(req_ids, np.array(starts), np.array(ends), np.array(ks))

    def _valid_prefix(self, rid: str, row: int, end: int) -> int:
        """How many leading positions of the request the draft's cache already holds: what it
        computed before, plus the drafts it fed itself that turned out to be the real tokens,
        or for a request it has not seen, its leading filled blocks (a prefix-cache hit)."""
        b = self.batch
        done = self.computed.get(rid)
        if done is None:
            filled = self.filled[b.block_ids(row)]
            done = (len(filled) if filled.all() else int(filled.argmin())) * self.block_size
        proposed = self.proposed.pop(rid, None)
        if proposed is not None:
            at, drafts = proposed
            fed = np.asarray(drafts[:-1], dtype=np.int64)  # the last draft was never an input
            real = b.token_ids[row, at : min(at + len(fed), end)]
            matched = real == fed[: len(real)]
            done = max(done, at + (len(matched) if matched.all() else int(matched.argmin())))
        return min(done, end - 1)  # at least the last token runs: its logits give the first draft

    def _run(self, req_ids: list[str], starts: np.ndarray, ends: np.ndarray, ks: np.ndarray) -> dict[str, list[int]]:
        b = self.batch
        rows = b.rows(req_ids)
        drafts: list[list[int]] = [[] for _ in req_ids]
        # pass 1: everything the draft has not seen; passes 2..k: the previous draft, one row each
        counts, positions = ends - starts, starts
        active = np.arange(len(req_ids))
        for step in range(int(ks.max())):
            lay = BatchLayout([req_ids[i] for i in active], rows[active], counts, positions,
                              decode_like_rows(counts, positions, SHORT_CHUNK))
            tokens = self._forward(lay)
            order = {rid: j for j, rid in enumerate(lay.req_ids)}
            for i in active:
                drafts[i].append(tokens[order[req_ids[i]]])
            active = active[ks[active] > step + 1]
            if not len(active):
                break
            # the draft just proposed becomes the next input, after the request's tokens
            at = ends[active] + step
            b.token_ids[rows[active], at] = [drafts[i][-1] for i in active]
            counts, positions = np.ones(len(active), dtype=np.int64), at
        for i, rid in enumerate(req_ids):
            self.computed[rid] = int(ends[i])
            self.proposed[rid] = (int(ends[i]), drafts[i])
            full = int(ends[i]) // self.block_size  # blocks holding only real tokens, all computed
            self.filled[b.block_table[rows[i], :full]] = True
        return {rid: drafts[i] for i, rid in enumerate(req_ids)}

    def _forward(self, lay: BatchLayout) -> list[int]:
        """One draft pass; the greedy next token of each request, in ``lay.req_ids`` order."""
        started = time.perf_counter()
        input_ids, positions, meta = prepare_inputs(self.batch, lay, self.backend, self.block_size, self.device)
        self.num_tokens_run += len(input_ids)
        with self.backend.batch_invariant(False), set_attention_metadata(meta):
            hidden = self.model(input_ids.to(self.device), positions.to(self.device))
            last = torch.from_numpy(lay.offsets + lay.counts - 1)
            logits = self.model.compute_logits(hidden[last.to(self.device)])
        tokens = logits.argmax(dim=-1).tolist()
        if lay.num_decode_like == len(lay.req_ids):  # a pass of decode rows, the usual one (catch-ups vary)
            self._pass_times.append(time.perf_counter() - started)
            self.pass_seconds = statistics.median(self._pass_times)
        return tokens
