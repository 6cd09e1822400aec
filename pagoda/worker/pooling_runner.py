"""The pooling runner (vLLM's `--runner pooling`): a step of whole prompts → the model's hidden
states → one vector a prompt (layers/pooler.py), in ``ModelRunnerOutput.pooler_output``.

It is the model runner without sampling: the same InputBatch, layout and attention metadata, the
same scheduler's steps. The scheduler gives a pooling request its whole prompt in one step and
finishes it there, so a step's rows are complete prompts and nothing is carried from step to
step. A decoder (``--runner pooling`` on a Llama) attends causally through its paged KV cache as
it would for a prompt it generates from; an encoder (BERT) keeps no cache and attends
bidirectionally within each prompt, so every prompt is laid out as one prefill chunk, never as
decode rows, and the chunks tell the model where its sequences start and end.
"""

from __future__ import annotations

import numpy as np
import torch

from pagoda.core.scheduler_output import SchedulerOutput
from pagoda.forward_context import set_attention_metadata
from pagoda.layers.pooler import finish_vectors, pool
from pagoda.outputs import ModelRunnerOutput
from pagoda.pooling_params import PoolerConfig
from pagoda.worker.batch_layout import prepare_inputs
from pagoda.worker.model_runner import ModelRunner


class PoolingRunner(ModelRunner):
    def __init__(self, *args, pooler: PoolerConfig, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pooler = pooler
        self.encoder = not getattr(self.model, "uses_kv_cache", True)

    def _decode_like(self, counts: np.ndarray, starts: np.ndarray) -> np.ndarray:
        if self.encoder:  # each prompt one prefill chunk: the sequences its attention keeps apart
            return np.zeros(len(counts), dtype=bool)
        return super()._decode_like(counts, starts)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.batch.apply(sched)
        out = ModelRunnerOutput()
        if sched.is_empty:
            return out
        lay = self._layout(sched)
        input_ids, positions, meta = prepare_inputs(self.batch, lay, self.backend, self.block_size, self.device)
        with self.backend.batch_invariant(self.deterministic), set_attention_metadata(meta):
            hidden = self.forward(input_ids.to(self.device), positions.to(self.device))
        if self.is_driver:
            vectors = pool(hidden, lay.offsets, lay.counts, self.pooler.pooling_type)
            if getattr(self.model, "classifies", False):  # a cross-encoder: the head's scores
                vectors = self.model.classify(vectors)
            params = [self.batch.states[rid].pooling_params for rid in lay.req_ids]
            out.pooler_output = dict(zip(lay.req_ids, finish_vectors(vectors, params, self.pooler.normalize)))
        return out
