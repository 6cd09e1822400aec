"""KV tiers in the engine: a prefix evicted from the KV cache comes back from host memory or disk
(after a restart too), and the answer is always the one computed fresh, with no cache at all."""

from __future__ import annotations

import random
import stat
from pathlib import Path

import pytest

from pagoda import LLM, SamplingParams
from pagoda.core.kv_tiers.block_format import ENCRYPTED, MAGIC

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SMALL = {"dtype": "float32", "kv_cache_memory": 0.0005}  # 32 blocks: a few prompts evict the first


def _prompt(seed: int, n: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(n)]


def _run(llm: LLM, tokens: list[int], salt: str | None = None):
    prompt = {"prompt_token_ids": tokens} if salt is None else {"prompt_token_ids": tokens, "cache_salt": salt}
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0]


def _evict(llm: LLM) -> None:
    for seed in range(100, 106):
        _run(llm, _prompt(seed))


@pytest.fixture(scope="module")
def fresh(tiny_llama):
    """The reference: no prefix cache, no tiers."""
    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory=0.02, enable_prefix_caching=False)
    yield lambda tokens: _run(llm, tokens).outputs[0].token_ids
    llm.shutdown()


def test_an_evicted_prefix_comes_back_from_host_memory_unchanged(tiny_llama, fresh):
    with LLM(model=str(tiny_llama), kv_offload_memory=0.01, **SMALL) as llm:
        prompt = _prompt(1)
        assert _run(llm, prompt).outputs[0].token_ids == fresh(prompt)
        _evict(llm)
        again = _run(llm, prompt)
        stats = llm.engine.stats()
    assert again.outputs[0].token_ids == fresh(prompt)
    assert again.num_cached_tokens == 192  # 12 whole blocks of the 199 looked up
    assert stats["kv_offload_memory_hit_tokens"] >= 192 and stats["kv_offload_saved_tokens"] > 0
    assert stats["kv_offload_disk_hit_tokens"] == 0


def test_a_restarted_engine_answers_from_disk_unchanged(tiny_llama, fresh, tmp_path):
    prompt = _prompt(2)
    with LLM(model=str(tiny_llama), kv_offload_dir=str(tmp_path / "kv"), **SMALL) as llm:
        _run(llm, prompt)
    files = list((tmp_path / "kv").glob("*/*.kv"))
    assert len(files) >= 12 and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    with LLM(model=str(tiny_llama), kv_offload_dir=str(tmp_path / "kv"), **SMALL) as llm:
        again = _run(llm, prompt)
        stats = llm.engine.stats()
    assert again.outputs[0].token_ids == fresh(prompt)
    assert again.num_cached_tokens == 192 and stats["kv_offload_disk_hit_tokens"] == 192


def test_selective_writes_only_what_is_used_again(tiny_llama, fresh, tmp_path):
    """write_through_selective: a prompt seen once writes nothing below host memory, not even when
    the tree evicts it; a prefix hit sends the reused blocks down, and a restart finds them."""
    kv_dir = tmp_path / "kv"
    selective = dict(kv_offload_dir=str(kv_dir), kv_offload_write_policy="write_through_selective", **SMALL)
    once, twice = _prompt(7), _prompt(8)
    with LLM(model=str(tiny_llama), **selective) as llm:
        _run(llm, once)
        _evict(llm)  # `once` goes down to host memory only
        _run(llm, twice)
        assert _run(llm, twice).num_cached_tokens == 192  # the hit: its 12 blocks are written
    assert len(list(kv_dir.glob("*/*.kv"))) == 12
    with LLM(model=str(tiny_llama), **selective) as llm:
        again, other = _run(llm, twice), _run(llm, once)
        stats = llm.engine.stats()
    assert again.num_cached_tokens == 192 and stats["kv_offload_disk_hit_tokens"] == 192
    assert other.num_cached_tokens == 0
    assert again.outputs[0].token_ids == fresh(twice) and other.outputs[0].token_ids == fresh(once)


def test_tenants_and_models_never_hit_each_others_blocks_on_disk(tiny_llama, fresh, tmp_path):
    from tiny_models import make_tiny_hf_model


    prompt, kv_dir = _prompt(3), str(tmp_path / "kv")
    with LLM(model=str(tiny_llama), kv_offload_dir=kv_dir, **SMALL) as llm:
        _run(llm, prompt, salt="tenant-a")
    with LLM(model=str(tiny_llama), kv_offload_dir=kv_dir, **SMALL) as llm:
        other_tenant = _run(llm, prompt, salt="tenant-b")
        no_tenant = _run(llm, prompt)
        same_tenant = _run(llm, prompt, salt="tenant-a")
    assert other_tenant.num_cached_tokens == 0 and no_tenant.num_cached_tokens == 0
    assert same_tenant.num_cached_tokens == 192
    assert other_tenant.outputs[0].token_ids == same_tenant.outputs[0].token_ids == fresh(prompt)
    other_model = make_tiny_hf_model("llama", tmp_path / "other", seed=7)  # the same shapes, other weights
    with LLM(model=str(other_model), kv_offload_dir=kv_dir, **SMALL) as llm:
        assert _run(llm, prompt, salt="tenant-a").num_cached_tokens == 0
    with LLM(model=str(tiny_llama), kv_offload_dir=kv_dir, kv_cache_dtype="bfloat16", **SMALL) as llm:
        assert _run(llm, prompt, salt="tenant-a").num_cached_tokens == 0  # another KV dtype: other keys


def test_an_int8_cache_offloads_its_codes_and_scales(tiny_llama, tmp_path):
    prompt = _prompt(4)
    args = dict(model=str(tiny_llama), kv_cache_dtype="int8", kv_offload_dir=str(tmp_path / "kv"), **SMALL)
    with LLM(enable_prefix_caching=False, dtype="float32", kv_cache_dtype="int8", model=str(tiny_llama)) as ref:
        want = _run(ref, prompt).outputs[0].token_ids
    with LLM(**args) as llm:
        _run(llm, prompt)
    with LLM(**args) as llm:
        again = _run(llm, prompt)
    assert again.num_cached_tokens == 192 and again.outputs[0].token_ids == want


def test_an_encrypted_models_kv_is_encrypted_on_disk(tiny_llama, tmp_path):
    from pagoda.loader import model_keys
    from pagoda.security import encryption

    key_file = encryption.generate_key_file(tmp_path / "model.key")
    sealed = encryption.encrypt_model(tiny_llama, tmp_path / "tiny.pgenc", model_keys.load_key(key_file))
    prompt = _prompt(5)
    args = dict(model=str(sealed), model_key_file=str(key_file), kv_offload_dir=str(tmp_path / "kv"), **SMALL)
    with LLM(**args) as llm:
        want = _run(llm, prompt).outputs[0].token_ids
    files = list((tmp_path / "kv").glob("*/*.kv"))
    assert files and all(f.read_bytes()[len(MAGIC)] == ENCRYPTED for f in files)
    with LLM(**args) as llm:
        again = _run(llm, prompt)
    assert again.num_cached_tokens == 192 and again.outputs[0].token_ids == want


def test_a_corrupted_file_is_refused_and_the_prefix_computed(tiny_llama, fresh, tmp_path, caplog):
    prompt, kv_dir = _prompt(6), tmp_path / "kv"
    with LLM(model=str(tiny_llama), kv_offload_dir=str(kv_dir), **SMALL) as llm:
        _run(llm, prompt)
    for f in kv_dir.glob("*/*.kv"):  # every block torn: none may be served
        f.write_bytes(f.read_bytes()[:100])
    with LLM(model=str(tiny_llama), kv_offload_dir=str(kv_dir), **SMALL) as llm:
        again = _run(llm, prompt)
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == fresh(prompt)
    assert "refused" in caplog.text


@pytest.mark.parametrize("args, named", [
    ({"enable_prefix_caching": False, "kv_offload_memory": 1.0}, "kv_offload: they sit under the prefix cache"),
    ({"kv_offload_memory": -1.0}, "kv_offload_memory must be >= 0"),
    ({"kv_offload_dir": "/tmp/x", "kv_offload_disk": 0.0}, "kv_offload_disk must be > 0"),
])
def test_bad_offload_settings_are_named(tiny_llama, args, named):
    with pytest.raises(ValueError, match=named):
        LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory=0.0005, **args)


def test_an_unwritable_directory_is_named(tiny_llama, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="kv_offload_dir"):
        LLM(model=str(tiny_llama), kv_offload_dir=str(Path(blocker) / "kv"), **SMALL)


def test_tier_hits_reach_the_prometheus_metrics(tiny_llama):
    from pagoda.entrypoints.prometheus import _EngineCollector

    with LLM(model=str(tiny_llama), kv_offload_memory=0.01, **SMALL) as llm:
        prompt = _prompt(8)
        _run(llm, prompt)
        _evict(llm)
        _run(llm, prompt)
        collected = _EngineCollector(llm.engine.core, "tiny").collect()
        metrics = {s.name: s.value for m in collected for s in m.samples}
    assert metrics["pagoda:kv_offload_memory_hits_total"] == 192
    assert metrics["pagoda:kv_offload_disk_hits_total"] == 0 and metrics["pagoda:kv_offload_saved_total"] > 0
