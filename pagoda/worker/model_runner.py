"""Runs one step for a worker: SchedulerOutput → batch tensors → model → sampler → ModelRunnerOutput.

The runner keeps its own record of the requests (``InputBatch``), updated from the scheduler's
deltas; it never sees the scheduler's ``Request`` objects. The batch is flat (no padding of
prompts): decode-like rows first, then prefill chunks. Logits are computed only where they are
needed: the last token of each request that samples this step, and the prompt positions of
requests that asked for prompt logprobs.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagoda.config import SchedulerConfig
from pagoda.core.kv_cache_groups import KVCacheGroups
from pagoda.core.scheduler_output import SchedulerOutput
from pagoda.forward_context import set_attention_metadata
from pagoda.models.decode_stack import ForwardPath
from pagoda.layers.sampler import Sampler, SamplingMetadata, sampling_probabilities
from pagoda.outputs import ModelRunnerOutput, TokenLogprobs
from pagoda.worker.compiled import compiled_forward
from pagoda.spec_decode.draft_model import DraftModelProposer
from pagoda.spec_decode.ngram import propose_ngram
from pagoda.spec_decode.rejection import accept_by_rejection
from pagoda.worker.batch_layout import BatchLayout, decode_like_rows, prepare_inputs, state_metadata
from pagoda.worker.image_embeddings import ImageEmbeddings
from pagoda.worker.input_batch import InputBatch
from pagoda.worker.lora_weights import LoRAWeights
from pagoda.worker.state_cache import copy_states

if TYPE_CHECKING:
    from pagoda.spec_decode.speculative_config import SpeculativeConfig

logger = logging.getLogger(__name__)

LOADING_PATH = ("the model is loading layer by layer: the Python layers run until every layer is in place, "
                "then the fused stack is chosen")
# A prefill chunk of at most this many tokens over a cached prefix runs as decode rows.
DEFAULT_SHORT_CHUNK = SchedulerConfig.short_chunk_tokens


def _stack_refusal(fused_decode: bool, compile: bool) -> str | None:
    """Why the engine's options keep the fused decode stack off, if they do."""
    if not fused_decode:
        return "turned off (fused_decode=False, --no-fused-decode)"
    if compile:
        return "torch.compile is on: the compiled Python layers run (Dynamo does not trace the C++ op)"
    return None


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int, device: torch.device,
                 max_model_len: int, generator: torch.Generator | None = None, compile: bool = False,
                 deterministic: bool = False, short_chunk: int = DEFAULT_SHORT_CHUNK,
                 is_driver: bool = True, speculative: SpeculativeConfig | None = None,
                 draft: tuple[torch.nn.Module, torch.Tensor] | None = None,
                 kv_groups: KVCacheGroups | None = None, kv_scales: torch.Tensor | None = None,
                 fused_decode: bool = True, loras: LoRAWeights | None = None) -> None:
        """``deterministic`` (EngineConfig.deterministic): batch-invariant inference, see
        ``_decode_like`` and ``execute``. ``is_driver``: this rank samples and reports (rank 0);
        the others only run the model. ``draft``: the draft model and its KV cache, for
        speculative decoding with ``method: draft_model``. ``kv_groups``: which layers share a
        block table and which slot of ``kv_cache`` each layer's K/V takes (default: one group,
        layer i in slot i). ``kv_scales``: an int8 cache's scales, laid out as ``kv_cache`` without
        its last dimension. ``fused_decode``: let decode batches take the fused C++ stack where the
        model allows (``forward_path`` says what was chosen and why). ``loras``: the LoRA adapters
        this rank holds (None: LoRA is off)."""
        self.model = model
        # Batch invariance takes pagoda's CPU kernels (the paged kernel for every row, the
        # invariant GEMM); without them (CUDA, no compiler) the layout stays as it is.
        self.backend = model.backend
        self.deterministic = deterministic and self.backend.has_cpu_kernels
        if deterministic and not self.deterministic:
            logger.warning("deterministic inference needs pagoda's CPU kernels: not available here, so results "
                           "may depend on the batch and on prefix caching")
        self.forward = compiled_forward(model) if compile else model.forward
        self.block_size = block_size
        self.device = device
        self.loras = loras
        self.short_chunk = short_chunk
        self.is_driver = is_driver
        self.speculative = speculative
        self.vocab_size = model.config.vocab_size
        self.sampler = Sampler(generator, self.backend.argmax_rows)
        layers = model.attention_layers()
        groups = kv_groups or KVCacheGroups.single(len(layers))
        self.state_layers = getattr(model, "state_layers", list)()  # a state-space model's (worker/state_cache.py)
        self.batch = InputBatch(max_model_len, block_size, num_kv_groups=groups.num_groups,
                                tracks_states=bool(self.state_layers))
        self._last_metadata: tuple[int, list[str], SamplingMetadata] | None = None  # see sampling_metadata
        for attn, group, slot in zip(layers, groups.layer_group, groups.layer_slot):
            scales = (kv_scales[0, slot], kv_scales[1, slot]) if kv_scales is not None else (None, None)
            attn.bind_kv_cache(kv_cache[0, slot], kv_cache[1, slot], group, *scales)
        refused = _stack_refusal(fused_decode, compile)
        loading = getattr(model, "loading", None)
        if loading is None:
            self.forward_path = model.choose_forward(refused)
        else:  # the stack takes the layers' final weights: chosen on the loader's thread once all are in
            self.forward_path = ForwardPath(False, LOADING_PATH)
            loading.when_loaded(lambda: setattr(self, "forward_path", model.choose_forward(refused)))
        self.images = ImageEmbeddings(model) if hasattr(model, "encode_images") else None  # a vision-language model
        self.drafter = None
        if draft is not None:
            self.drafter = DraftModelProposer(draft[0], draft[1], self.batch, block_size, device,
                                              speculative.num_speculative_tokens, speculative.adaptive)
            draft[0].choose_forward(refused)

    # -- batch layout -----------------------------------------------------------------------
    # A short chunk over a cached prefix (a prefix-cache hit's remaining prompt tokens, the tail
    # of a chunked prompt) runs as one decode row per token: row j attends to the first
    # start + j + 1 positions, read in place by the paged kernel instead of gathering the prefix.
    # Under deterministic inference every chunk runs so, whatever its length or prefix: a token's
    # attention is then computed the same way whether it is a decode, in a fresh prompt, after a
    # cache hit or in any chunk (the paged kernel tiles a chunk's rows without changing a row's
    # sums), and a batch of decode-like rows only runs as one C++ call (models/decode_stack.py).
    # With the C++ kernels a short fresh prompt runs so too: up to a few hundred tokens the paged
    # kernel's rows take about half the attention time of one causal SDPA call per prompt
    # (benchmarks/README.md, "short prompts as decode rows"), and a step of decodes and short
    # prompts stays one C++ call. The torch backend would gather
    # every row's blocks, so there only a cached prefix's chunk does.
    def _decode_like(self, counts: np.ndarray, starts: np.ndarray) -> np.ndarray:
        if self.deterministic:
            return np.ones(len(counts), dtype=bool)
        return decode_like_rows(counts, starts, self.short_chunk, fresh=self.backend.has_cpu_kernels)

    def _layout(self, sched: SchedulerOutput) -> BatchLayout:
        req_ids = list(sched.num_scheduled_tokens)
        rows = self.batch.rows(req_ids)
        if self.loras is not None and self.batch.lora_ids[rows].any():  # each adapter's rows side by side:
            order = np.argsort(self.batch.lora_ids[rows], kind="stable")  # its deltas take whole slices
            req_ids, rows = [req_ids[i] for i in order], rows[order]
        counts = np.fromiter((sched.num_scheduled_tokens[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        starts = self.batch.num_computed[rows]
        decode_like = self._decode_like(counts, starts)
        if self.images is not None:  # image tokens that attend both ways run as a prefill chunk
            decode_like &= ~self.images.holds_images(self.batch, req_ids, starts, counts)
        return BatchLayout(req_ids, rows, counts, starts, decode_like)

    # -- run --------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        started = self._step_started = time.perf_counter()
        self.batch.apply(sched)
        if self.loras is not None:
            self.loras.apply(sched)
        if self.drafter is not None:
            self.drafter.observe(sched)
        out = ModelRunnerOutput()
        if sched.is_empty:
            return out
        lay = self._layout(sched)
        input_ids, positions, meta = prepare_inputs(self.batch, lay, self.backend, self.block_size, self.device)
        if self.loras is not None:
            meta.lora = self.loras.batch_for(self.batch.lora_ids[lay.token_rows])
        images = self.images.step(self.batch, lay, meta) if self.images is not None else None
        if self.state_layers:  # a kept prefix's state into the slots of the requests that start after it
            copy_states(self.state_layers, sched.state_copies)
            meta.states = state_metadata(self.batch, lay, self.device, sched.state_saves)
        sample_idx, verify_idx, prompt_rows = self._logit_rows(lay, sched)
        # the kernels' batch-invariant switch, set for each step (another engine may share the process)
        with self.backend.batch_invariant(self.deterministic):
            with set_attention_metadata(meta):
                ids, pos = input_ids.to(self.device), positions.to(self.device)
                hidden = self.forward(ids, pos) if images is None else self.images.forward(ids, pos, images)
            if sample_idx:
                if len(sample_idx) == hidden.shape[0]:
                    last_rows = hidden  # every row is a sampling request's one row (a decode step)
                else:
                    flat = torch.from_numpy((lay.offsets + lay.counts - 1)[sample_idx])  # each one's last row
                    last_rows = hidden[flat.to(hidden.device)]
                logits = self.model.compute_logits(last_rows)
                if self.is_driver:
                    self._sample(logits.float().cpu(), [lay.req_ids[i] for i in sample_idx], sched, out)
            if verify_idx:
                self._verify(hidden, lay, verify_idx, sched, out)
            for rid, rows, targets, k in prompt_rows:
                logits = self.model.compute_logits(hidden[rows])
                if self.is_driver:
                    out.prompt_logprobs[rid] = _prompt_logprobs(logits.float().cpu(), targets, k)
        if verify_idx:
            out.spec_verify_seconds = time.perf_counter() - started
        limit = self.speculative.disable_by_batch_size if self.speculative is not None else None
        if self.speculative is not None and self.is_driver and (limit is None or len(lay.req_ids) <= limit):
            proposing = time.perf_counter()
            # (the scheduler would not verify drafts in a bigger batch)
            self._propose(out, decode_step=lay.num_decode_like == len(lay.req_ids))
            out.spec_draft_seconds = time.perf_counter() - proposing
        return out

    # -- speculative decoding ---------------------------------------------------------------
    def _verify(self, hidden: torch.Tensor, lay: BatchLayout, verify_idx: list[int], sched: SchedulerOutput,
                out: ModelRunnerOutput) -> None:
        """Verify every request's drafts in one pass: the target's distribution at the last token
        and after each draft, each row processed as if the drafts before it had been sampled
        (its request's penalties over the outputs so far, min_tokens, logit bias, the grammar's
        mask at that position, temperature and top-k / top-p / min-p). A greedy request accepts
        drafts while they equal the target's choice; a sampling one by rejection sampling
        (``accept_by_rejection``, spec_decode/rejection.py). Either way the run ends with a token of the target's own, so
        a step gives at least one token; logprobs are those of each token of the run."""
        rows = [r for i in verify_idx for r in range(int(lay.offsets[i]), int(lay.offsets[i] + lay.counts[i]))]
        logits = self.model.compute_logits(hidden[rows])
        if not self.is_driver:
            return
        owners = [lay.req_ids[i] for i in verify_idx for _ in range(int(lay.counts[i]))]
        steps = np.concatenate([np.arange(int(lay.counts[i])) for i in verify_idx])  # each row's place in its run
        md = self.sampling_metadata(owners, sched, steps)  # each row: its request's parameters at that place
        logits = logits.float().cpu()
        processed = self.sampler.processed_logits(logits, md)
        choices = self.sampler.argmax_rows(processed).tolist()
        probs = None if md.all_greedy else sampling_probabilities(processed, md)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if md.max_num_logprobs is not None else None
        at = 0
        for i in verify_idx:
            rid, n = lay.req_ids[i], int(lay.counts[i])
            drafts = sched.scheduled_spec_tokens[rid]
            if md.greedy[at]:
                targets = choices[at : at + n]
                accepted = 0
                while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
                    accepted += 1
                tokens = targets[: accepted + 1]
            else:
                generator = self.batch.states[rid].generator or self.sampler.generator
                tokens = accept_by_rejection(probs[at : at + n], drafts, generator)
            out.sampled_token_ids[rid] = tokens
            if self.drafter is not None:
                self.drafter.record_verification(rid, len(drafts), len(tokens) - 1)
            k = self.batch.states[rid].sampling_params.logprobs
            if k is not None:
                out.logprobs[rid] = token_logprobs(raw_logprobs[at : at + len(tokens)], tokens, k)
            at += n

    def _propose(self, out: ModelRunnerOutput, decode_step: bool) -> None:
        """Drafts for the next step (n-gram prompt lookup or the draft model) for every request
        that sampled, unless it opted out (``SamplingParams.speculative``): verification applies
        each request's sampling in full (``_verify``)."""
        spec, b = self.speculative, self.batch
        wanted = {rid: tokens for rid, tokens in out.sampled_token_ids.items()
                  if b.states[rid].sampling_params.speculative}  # a request may opt out
        if self.drafter is not None:
            if decode_step:  # the unit of a draft's cost: a step without prefill rows
                self.drafter.record_step(time.perf_counter() - self._step_started)
            out.spec_token_ids.update(self.drafter.propose(wanted))
            return
        for rid, tokens in wanted.items():
            row = b.index[rid]
            history = np.concatenate([b.token_ids[row, : b.num_tokens[row]], np.asarray(tokens, dtype=np.int64)])
            drafts = propose_ngram(history, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
            if drafts:
                out.spec_token_ids[rid] = drafts

    def _logit_rows(self, lay: BatchLayout, sched: SchedulerOutput):
        """Which requests sample (they complete their tokens this step), which verify drafts
        (every row of theirs), and which flat rows need logits for prompt logprobs."""
        b = self.batch
        complete = lay.starts + lay.counts == b.num_tokens[lay.rows]  # its last token runs this step
        verify_idx: list[int] = []
        if sched.scheduled_spec_tokens:
            verifying = np.fromiter((rid in sched.scheduled_spec_tokens for rid in lay.req_ids), dtype=bool,
                                    count=len(lay.req_ids))
            verify_idx = np.flatnonzero(verifying).tolist()
            complete &= ~verifying
        sample_idx: list[int] = np.flatnonzero(complete).tolist()
        prompt_rows = []
        for i, rid in enumerate(lay.req_ids if b.prompt_logprob_ids else ()):
            if rid not in b.prompt_logprob_ids:
                continue
            row, start, n, offset = int(lay.rows[i]), int(lay.starts[i]), int(lay.counts[i]), int(lay.offsets[i])
            state = b.states[rid]
            k = state.sampling_params.prompt_logprobs
            begin = max(start, state.num_prompt_logprobs_done)
            end = min(start + n, int(b.num_prompt[row]) - 1)
            if end > begin:
                rows = list(range(offset + begin - start, offset + end - start))
                prompt_rows.append((rid, rows, b.token_ids[row, begin + 1 : end + 1].tolist(), k))
                state.num_prompt_logprobs_done = end
        return sample_idx, verify_idx, prompt_rows

    def _sample(self, logits: torch.Tensor, req_ids: list[str], sched: SchedulerOutput,
                out: ModelRunnerOutput) -> None:
        md = self.sampling_metadata(req_ids, sched)
        result = self.sampler(logits, md)
        tokens = result.token_ids.tolist()
        out.sampled_token_ids.update((rid, [token]) for rid, token in zip(req_ids, tokens))
        if result.logprobs is not None:
            ids, lps, ranks = result.logprob_token_ids.tolist(), result.logprobs.tolist(), result.sampled_ranks.tolist()
            for i, rid in enumerate(req_ids):
                k = self.batch.states[rid].sampling_params.logprobs
                if k is not None:
                    out.logprobs[rid] = [TokenLogprobs(ids[i][: 1 + k], lps[i][: 1 + k], ranks[i])]

    # -- sampling metadata, gathered from the persistent rows -----------------------------
    def sampling_metadata(self, req_ids: list[str], sched: SchedulerOutput,
                          steps: np.ndarray | None = None) -> SamplingMetadata:
        """Row i samples for ``req_ids[i]``; ``steps[i]`` (verification) is how many of its
        request's drafts precede that row, counted as outputs (penalties, min_tokens) and as
        grammar positions.

        A decode step whose requests are those of the last one, in the same order, with nothing
        that changes from step to step (penalties over the outputs, min_tokens, logit bias, seeds,
        logprobs, a grammar, verification rows), gets the last step's metadata again."""
        b, vocab = self.batch, self.vocab_size
        reusable = steps is None and sched.grammar_bitmask is None and not b.special_ids
        last = self._last_metadata
        if reusable and last is not None and last[0] == b.version and last[1] == req_ids:
            return last[2]
        rows = b.rows(req_ids)
        ends = b.num_tokens[rows] + (steps if steps is not None else 0)  # each row's tokens so far
        # (row, state) of the rows whose parameters are looked at one by one (InputBatch.special_ids)
        special = [(i, b.states[r]) for i, r in enumerate(req_ids) if r in b.special_ids] if b.special_ids else []
        greedy = b.greedy[rows]
        top_k, top_p, min_p = b.top_k[rows], b.top_p[rows], b.min_p[rows]
        md = SamplingMetadata(
            temperature=torch.from_numpy(b.temperature[rows]),
            greedy=torch.from_numpy(greedy),
            all_greedy=bool(greedy.all()),
            top_k=torch.from_numpy(np.where(top_k > 0, top_k, vocab)) if (top_k > 0).any() else None,
            top_p=torch.from_numpy(top_p) if (top_p < 1.0).any() else None,
            min_p=torch.from_numpy(min_p) if (min_p > 0.0).any() else None,
            generators={i: s.generator for i, s in special if s.generator is not None and not greedy[i]},
        )
        self._add_penalties(md, rows, ends)
        _add_sparse(md, special, ends - b.num_prompt[rows], vocab)
        self._add_grammar_mask(md, req_ids, sched, steps)
        wanted = [s.sampling_params.logprobs for _, s in special if s.sampling_params.logprobs is not None]
        md.max_num_logprobs = max(wanted) if wanted else None
        self._last_metadata = (b.version, list(req_ids), md) if reusable and md.output_tokens is None else None
        return md

    def _add_penalties(self, md: SamplingMetadata, rows: np.ndarray, ends: np.ndarray) -> None:
        b = self.batch
        presence, frequency, repetition = b.presence[rows], b.frequency[rows], b.repetition[rows]
        uses = (presence != 0.0).any(), (frequency != 0.0).any(), (repetition != 1.0).any()
        if not any(uses):
            return
        md.output_tokens = b.padded_tokens(rows, b.num_prompt[rows], ends)
        if uses[0]:
            md.presence = torch.from_numpy(presence)
        if uses[1]:
            md.frequency = torch.from_numpy(frequency)
        if uses[2]:
            md.repetition = torch.from_numpy(repetition)
            prompt_end = np.where(repetition != 1.0, b.num_prompt[rows], 0)
            md.prompt_tokens = b.padded_tokens(rows, np.zeros_like(prompt_end), prompt_end)

    @staticmethod
    def _add_grammar_mask(md: SamplingMetadata, req_ids: list[str], sched: SchedulerOutput,
                          steps: np.ndarray | None) -> None:
        """The scheduler's bitmask rows (its matchers live there), placed at this batch's rows: a
        request's first row, then one per draft it verifies (the mask after those drafts)."""
        if sched.grammar_bitmask is None:
            return
        rows = [(i, sched.grammar_rows[rid] + (int(steps[i]) if steps is not None else 0))
                for i, rid in enumerate(req_ids) if rid in sched.grammar_rows]
        if not rows:
            return
        mask = torch.full((len(req_ids), sched.grammar_bitmask.shape[1]), -1, dtype=torch.int32)
        for dst, src in rows:
            mask[dst] = sched.grammar_bitmask[src]
        md.token_bitmask, md.bitmask_rows = mask, [dst for dst, _ in rows]


def token_logprobs(raw: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprobs]:
    """Each token's logprob in its row of ``raw`` (log-softmax of the model's logits), its rank,
    and the row's top ``k``."""
    chosen_ids = torch.tensor(tokens, dtype=torch.long).unsqueeze(1)
    chosen = raw.gather(1, chosen_ids)
    ranks = ((raw > chosen).sum(dim=-1) + 1).tolist()
    top_lp, top_ids = raw.topk(k, dim=-1) if k > 0 else (raw[:, :0], chosen_ids[:, :0])
    ids = torch.cat([chosen_ids, top_ids], dim=1).tolist()
    values = torch.cat([chosen, top_lp], dim=1).tolist()
    return [TokenLogprobs(ids[i], values[i], ranks[i]) for i in range(len(tokens))]


def _prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    return token_logprobs(torch.log_softmax(logits, dim=-1), targets, k)


def _add_sparse(md: SamplingMetadata, special: list, num_output: np.ndarray, vocab_size: int) -> None:
    """Logit bias and the min_tokens ban of stop tokens: (row, token) pairs, rare, so per request
    (``special``: (row, state) of the requests that may have them)."""
    bias = [(i, t, v) for i, s in special for t, v in (s.sampling_params.logit_bias or {}).items()
            if t < vocab_size]
    if bias:
        rows, toks, vals = zip(*bias)
        md.bias_rows, md.bias_tokens = torch.tensor(rows), torch.tensor(toks)
        md.bias_values = torch.tensor(vals, dtype=torch.float32)
    banned = []
    for i, s in special:
        p = s.sampling_params
        if num_output[i] < p.min_tokens:
            stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else p.all_stop_token_ids)
            banned += [(i, t) for t in stop_ids if t < vocab_size]
    if banned:
        rows, toks = zip(*banned)
        md.banned_rows, md.banned_tokens = torch.tensor(rows), torch.tensor(toks)
