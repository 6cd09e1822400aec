"""The scheduler → worker contract: the worker gets a plain SchedulerOutput and answers with a
plain ModelRunnerOutput; it never writes the scheduler's state, and it works from the message
alone (as a worker in another process does)."""

from __future__ import annotations

import ast
import copy
import pickle
from pathlib import Path


from pagoda import LLM, SamplingParams
from pagoda.sampling_params import StructuredOutputsParams

WORKER_SIDE = ["worker", "executor", "distributed", "layers", "models"]


def _snapshot(core) -> dict:
    """Everything the scheduler owns that a worker could touch."""
    requests = {
        rid: (r.status, list(r.all_token_ids), list(r.output_token_ids), r.num_computed_tokens, list(r.block_ids),
              r.num_prompt_logprobs_done, r.num_preemptions, copy.deepcopy(r.sampling_params))
        for rid, r in core.scheduler.requests.items()
    }
    return {"requests": requests, "free": core.kv_manager.num_free_blocks,
            "running": [r.request_id for r in core.scheduler.running]}


def _workload(llm: LLM) -> list:
    prompts = ["hello world " * k for k in range(1, 9)]
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, logprobs=3),
        SamplingParams(max_tokens=12, temperature=0.9, seed=5, top_k=20, top_p=0.9),
        SamplingParams(max_tokens=12, temperature=0.0, prompt_logprobs=2, presence_penalty=0.5, repetition_penalty=1.2),
        SamplingParams(max_tokens=12, temperature=1.0, seed=11, min_p=0.05, min_tokens=4, frequency_penalty=0.3,
                       logit_bias={5: 2.0}),
        SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=StructuredOutputsParams(regex="[a-c]+")),
    ] * 2
    outs = llm.generate(prompts, params[: len(prompts)], use_tqdm=False)
    return [(o.outputs[0].token_ids, [sorted(p.items()) for p in o.outputs[0].logprobs or []],
             [sorted(p.items()) for p in (o.prompt_logprobs or [])[1:]]) for o in outs]


def _small_cache_llm(path) -> LLM:
    # A small cache and budget: chunked prefill and preemption happen. Batch-invariant, since the
    # two engines' batches may differ: a regex request is admitted once its grammar has compiled on
    # a worker thread, a step sooner or later with the machine's load (seen as a greedy near-tie
    # that went the other way).
    return LLM(str(path), dtype="float32", kv_cache_memory=0.0001, max_num_batched_tokens=24, seed=3,
               deterministic=True)


def test_worker_never_writes_scheduler_state_and_runs_from_the_message_alone(tiny_llama, monkeypatch):
    """The same workload on two fresh engines: one as it is, one whose
    worker gets a pickled copy of each message and whose step is checked not to touch the
    scheduler's state. The answers must be identical."""
    expected = _workload(_small_cache_llm(tiny_llama))
    llm = _small_cache_llm(tiny_llama)
    core = llm.engine.core
    execute = core.executor.execute_model
    steps = []

    def watched(sched):
        before, message = _snapshot(core), pickle.dumps(sched)
        out = execute(pickle.loads(message))  # a copy: nothing the worker holds is shared
        assert _snapshot(core) == before, "the worker changed the scheduler's state"
        assert pickle.dumps(sched) == message, "the worker changed the scheduler's message"
        steps.append(sched)
        return pickle.loads(pickle.dumps(out))

    monkeypatch.setattr(core.executor, "execute_model", watched)
    assert _workload(llm) == expected
    assert core.scheduler.num_preemptions_total > 0  # the workload did preempt
    assert any(c.resumed_from_preemption for s in steps for c in s.cached_requests)
    assert core.kv_manager.usage() == 0.0


def test_worker_side_never_imports_the_request():
    """The worker side sees requests only through SchedulerOutput."""
    root = Path(__file__).resolve().parents[2] / "pagoda"
    for package in WORKER_SIDE:
        for path in (root / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom):
                    assert node.module not in ("pagoda.request", "pagoda.core.scheduler"), f"{path} imports {node.module}"
