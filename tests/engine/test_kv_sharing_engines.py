"""Replicas sharing KV: engine B, started before engine A computed a prefix, gets a hit on it from
a shared directory or a real Valkey / Redis server, with the answer of a fresh computation; a
tenant never hits another's blocks in the shared store; a prefill engine (--kv-role prefill) has
written its prompt's blocks by the time it answers."""

from __future__ import annotations

import random

import pytest

from pagoda import LLM, SamplingParams
from valkey_process import start_valkey, stop_valkey

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SMALL = {"dtype": "float32", "kv_cache_memory": 0.0005}


def _prompt(seed: int, n: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


def _run(llm: LLM, tokens: list[int], salt: str | None = None, params: SamplingParams = GREEDY):
    prompt = {"prompt_token_ids": tokens} if salt is None else {"prompt_token_ids": tokens, "cache_salt": salt}
    return llm.generate([prompt], params, use_tqdm=False)[0]


@pytest.fixture(scope="module")
def fresh(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory=0.02, enable_prefix_caching=False)
    yield lambda tokens: _run(llm, tokens).outputs[0].token_ids
    llm.shutdown()


@pytest.fixture
def valkey(tmp_path):
    proc, url = start_valkey(tmp_path)
    yield url
    stop_valkey(proc)


@pytest.mark.parametrize("shared", ["dir", "url"])
def test_replica_b_hits_the_prefix_replica_a_computed(tiny_llama, fresh, tmp_path, shared, request):
    where = {"kv_offload_dir": str(tmp_path / "kv")} if shared == "dir" else \
        {"kv_offload_url": request.getfixturevalue("valkey")}
    prompt = _prompt(1)
    with LLM(model=str(tiny_llama), **where, **SMALL) as a, LLM(model=str(tiny_llama), **where, **SMALL) as b:
        first = _run(a, prompt)
        a.engine.client.core.kv_tiers.flush()  # A's background writes are done (what a prefill role waits for)
        hit = _run(b, prompt)
        stats = b.engine.stats()
    assert first.num_cached_tokens == 0 and hit.num_cached_tokens == 192
    assert hit.outputs[0].token_ids == first.outputs[0].token_ids == fresh(prompt)
    assert stats["kv_offload_disk_hit_tokens"] == 192
    assert (stats["kv_offload_remote_read_tokens"] >= 192) if shared == "url" else stats["kv_offload_remote_read_tokens"] == 0


def test_tenant_b_never_hits_tenant_as_blocks_in_the_shared_store(tiny_llama, fresh, valkey):
    prompt = _prompt(2)
    with LLM(model=str(tiny_llama), kv_offload_url=valkey, **SMALL) as a:
        _run(a, prompt, salt="tenant-a")
    with LLM(model=str(tiny_llama), kv_offload_url=valkey, **SMALL) as b:
        other = _run(b, prompt, salt="tenant-b")
        none = _run(b, prompt)
        same = _run(b, prompt, salt="tenant-a")
    assert other.num_cached_tokens == 0 and none.num_cached_tokens == 0 and same.num_cached_tokens == 192
    assert other.outputs[0].token_ids == same.outputs[0].token_ids == fresh(prompt)


def test_a_directory_and_the_store_side_by_side(tiny_llama, fresh, tmp_path, valkey):
    prompt = _prompt(3)
    with LLM(model=str(tiny_llama), kv_offload_dir=str(tmp_path / "a"), kv_offload_url=valkey, **SMALL) as a:
        _run(a, prompt)
    assert len(list((tmp_path / "a").glob("*/*.kv"))) >= 12  # written to both
    with LLM(model=str(tiny_llama), kv_offload_dir=str(tmp_path / "b"), kv_offload_url=valkey, **SMALL) as b:
        again = _run(b, prompt)  # another host's directory: the store has it
        stats = b.engine.stats()
    assert again.num_cached_tokens == 192 and stats["kv_offload_remote_read_tokens"] >= 192  # read ahead, maybe twice
    assert again.outputs[0].token_ids == fresh(prompt)


def test_a_prefill_engine_has_shared_its_blocks_when_it_answers(tiny_llama, fresh, valkey):
    prompt = _prompt(4)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    with LLM(model=str(tiny_llama), kv_offload_url=valkey, kv_role="prefill", **SMALL) as p, \
            LLM(model=str(tiny_llama), kv_offload_url=valkey, kv_role="decode", **SMALL) as d:
        first = _run(p, prompt, params=one)  # no flush: the prefill role waited for its writes
        rest = _run(d, prompt)
    assert rest.num_cached_tokens == 192
    assert first.outputs[0].token_ids == rest.outputs[0].token_ids[:1]
    assert rest.outputs[0].token_ids == fresh(prompt)


@pytest.mark.parametrize("args, named", [
    ({"kv_role": "prefill"}, "kv_role .*needs a shared KV tier"),
    ({"kv_role": "sideways"}, "kv_role must be one of"),
    ({"kv_offload_url": "redis://127.0.0.1:1"}, "kv_offload_url .*cannot reach"),
])
def test_bad_sharing_settings_are_named(tiny_llama, args, named):
    with pytest.raises(ValueError, match=named):
        LLM(model=str(tiny_llama), **SMALL, **args)
