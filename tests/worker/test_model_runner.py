"""The model runner (pagoda/worker/model_runner.py) fed SchedulerOutputs by hand: a prompt whole or
in chunks, decodes, several requests in one batch, prompt logprobs. Its greedy tokens are
transformers' on the same weights, and a row's result does not depend on its batch."""

from __future__ import annotations

import pytest
import torch

from pagoda.config import create_engine_config
from pagoda.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagoda.engine_args import EngineArgs
from pagoda.loader.model_loader import load_model
from pagoda.sampling_params import SamplingParams
from pagoda.worker.kv_cache import allocate_kv_cache
from pagoda.worker.model_runner import ModelRunner
from pagoda.worker.worker import prepare_backend

BLOCK = 8
PROMPTS = {"a": [5, 17, 42, 8, 99, 3, 71, 23, 14, 60], "b": [7, 7, 31, 2, 88]}
STEPS = 5


@pytest.fixture(scope="module")
def model(tiny_llama):
    config = create_engine_config(EngineArgs(model=str(tiny_llama), dtype="float32", device="cpu"))
    mc = config.model
    return load_model(mc.files, mc.hf_config, mc.dtype, mc.device, mc.max_model_len, backend=prepare_backend(mc.device))


@pytest.fixture(scope="module")
def expected(tiny_llama) -> dict[str, list[int]]:
    """transformers' greedy continuation of each prompt."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    out = {}
    for rid, prompt in PROMPTS.items():
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, min_new_tokens=STEPS)
        out[rid] = ids[0, len(prompt):].tolist()
    return out


def _runner(model) -> ModelRunner:
    cfg = model.config
    cache = allocate_kv_cache(cfg.num_layers, 16, BLOCK, model.num_local_kv_heads, cfg.head_dim, torch.float32,
                              torch.device("cpu"))
    return ModelRunner(model, cache, BLOCK, torch.device("cpu"), max_model_len=64)


def _blocks(rid: str) -> list[int]:
    return [0, 1] if rid == "a" else [2, 3]  # room for prompt + STEPS tokens


def _greedy(**extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, **extra)


def _decode(runner: ModelRunner, tokens: dict[str, list[int]], steps: int) -> None:
    """Decode ``steps`` more tokens for every request, feeding each its last sampled token."""
    for _ in range(steps):
        cached = [CachedRequestData(rid, [t[-1]], [], len(PROMPTS[rid]) + len(t) - 1) for rid, t in tokens.items()]
        out = runner.execute(SchedulerOutput(cached_requests=cached, num_scheduled_tokens={rid: 1 for rid in tokens}))
        for rid in tokens:
            tokens[rid] += out.sampled_token_ids[rid]


def test_prefill_then_decodes_give_transformers_greedy_tokens(model, expected):
    runner = _runner(model)
    prompt = PROMPTS["a"]
    out = runner.execute(SchedulerOutput(new_requests=[NewRequestData("a", prompt, _greedy(), _blocks("a"), 0)],
                                         num_scheduled_tokens={"a": len(prompt)}))
    tokens = {"a": out.sampled_token_ids["a"]}
    _decode(runner, tokens, STEPS - 1)
    assert tokens["a"] == expected["a"]


def test_a_chunked_prompt_samples_after_its_last_chunk_only(model, expected):
    runner = _runner(model)
    prompt = PROMPTS["a"]
    first = runner.execute(SchedulerOutput(new_requests=[NewRequestData("a", prompt, _greedy(), _blocks("a"), 0)],
                                           num_scheduled_tokens={"a": 6}))
    assert "a" not in first.sampled_token_ids  # mid-prompt: nothing to sample yet
    rest = runner.execute(SchedulerOutput(cached_requests=[CachedRequestData("a", [], [], 6)],
                                          num_scheduled_tokens={"a": len(prompt) - 6}))
    tokens = {"a": rest.sampled_token_ids["a"]}
    _decode(runner, tokens, STEPS - 1)
    assert tokens["a"] == expected["a"]


def test_requests_batched_together_give_their_tokens_alone(model, expected):
    runner = _runner(model)
    new = [NewRequestData(rid, p, _greedy(), _blocks(rid), 0) for rid, p in PROMPTS.items()]
    out = runner.execute(SchedulerOutput(new_requests=new, num_scheduled_tokens={r: len(p) for r, p in PROMPTS.items()}))
    tokens = {rid: out.sampled_token_ids[rid] for rid in PROMPTS}
    _decode(runner, tokens, STEPS - 1)
    assert tokens == expected


def test_prompt_logprobs_cover_every_prompt_position(model):
    runner = _runner(model)
    prompt = PROMPTS["b"]
    params = _greedy(prompt_logprobs=2)
    out = runner.execute(SchedulerOutput(new_requests=[NewRequestData("b", prompt, params, _blocks("b"), 0)],
                                         num_scheduled_tokens={"b": len(prompt)}))
    positions = out.prompt_logprobs["b"]
    assert len(positions) == len(prompt) - 1  # every prompt token after the first, given what precedes it
    for target, pos in zip(prompt[1:], positions):
        assert pos.token_ids[0] == target and len(pos.token_ids) == 3  # the prompt's token, then the top 2
        assert pos.rank >= 1 and pos.logprobs[0] <= 0


def test_the_runner_reports_the_forward_it_chose(model):
    path = _runner(model).forward_path
    assert path.fused_decode == (model.backend.decode_stack_ops() is not None) and path.reason
