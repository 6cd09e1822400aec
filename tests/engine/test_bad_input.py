"""Bad input gets a clear ValueError that names the problem, and the engine keeps serving."""

from __future__ import annotations

import json
import shutil

import pytest

from pagoda import LLM, SamplingParams


def test_prompt_longer_than_context(tiny_llm):
    long_prompt = {"prompt_token_ids": [5] * 300}
    with pytest.raises(ValueError, match=r"prompt has 300 tokens.*256"):
        tiny_llm.generate([long_prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    # still serving
    assert tiny_llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_bad_token_ids_and_empty_prompt(tiny_llm):
    with pytest.raises(ValueError, match="token ids must be in"):
        tiny_llm.generate([{"prompt_token_ids": [1, 99999]}], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        tiny_llm.generate([{"prompt_token_ids": []}], use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished_requests()
    assert tiny_llm.engine.core.kv_manager.num_free_blocks == tiny_llm.engine.core.num_blocks


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("n", 0),
    ("min_p", 2.0), ("presence_penalty", 3.0), ("repetition_penalty", 0.0), ("logprobs", 21), ("stop", [""]),
    # integers that would overflow the int64 tensors they reach (top_k 2**70 once killed the engine)
    ("top_k", 2**70), ("seed", 2**64), ("stop_token_ids", [2**63]), ("logit_bias", {2**63: 1.0}),
])
def test_sampling_params_name_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_unknown_model_name_lists_catalog():
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        LLM(model="no-such-model-anywhere")


def test_unsupported_architecture_lists_supported(tiny_llama, tmp_path):
    d = tmp_path / "weird"
    shutil.copytree(tiny_llama, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unsupported model architecture.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLM(model=str(d))


def test_truncated_safetensors(tiny_llama, tmp_path):
    d = tmp_path / "trunc"
    shutil.copytree(tiny_llama, d)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"truncated or corrupt"):
        LLM(model=str(d), dtype="float32", kv_cache_memory=0.01)


def test_bad_engine_args(tiny_llama):
    with pytest.raises(ValueError, match="dtype"):
        LLM(model=str(tiny_llama), dtype="int3")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model=str(tiny_llama), max_model_len=100_000)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM(model=str(tiny_llama), kv_cache_memory=1e-9)


def test_hub_repo_id_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"could not download 'some-org/some-model'.*Offline"):
        LLM(model="some-org/some-model")
