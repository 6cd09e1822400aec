"""Adapters pagoda cannot serve exactly are refused before anything is queued, with the reason."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from pagoda import SamplingParams
from pagoda.lora import LoRARequest
from pagoda.lora.adapter import AdapterError
from pagoda.lora.peft_adapter import read_peft_adapter
from tests.lora.adapters import make_peft_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def adapter(tiny_llama, tmp_path_factory):
    return make_peft_adapter(tiny_llama, tmp_path_factory.mktemp("lora") / "a", rank=8)


def _edit_config(src, dst, **changes):
    dst.mkdir()
    config = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    (dst / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    return dst


def test_reads_rank_scale_and_modules(adapter, tiny_llama):
    hf_config = json.loads((tiny_llama / "config.json").read_text())
    read = read_peft_adapter(str(adapter), hf_config, max_rank=8)
    assert read.rank == 8
    assert len(read.pairs) == 7 * hf_config["num_hidden_layers"]
    assert {p.scale for p in read.pairs.values()} == {16 / 8}  # lora_alpha / r


@pytest.mark.parametrize("change, message", [
    ({"use_dora": True}, "DoRA"),
    ({"bias": "all"}, "trains biases"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"peft_type": "IA3"}, "LoRA only"),
])
def test_refused_configs(adapter, tiny_llama, tmp_path, change, message):
    hf_config = json.loads((tiny_llama / "config.json").read_text())
    with pytest.raises(AdapterError, match=message):
        read_peft_adapter(str(_edit_config(adapter, tmp_path / "edited", **change)), hf_config, max_rank=16)


def test_refused_adapters_name_the_problem(adapter, tiny_llama, tmp_path):
    hf_config = json.loads((tiny_llama / "config.json").read_text())
    with pytest.raises(AdapterError, match="rank 8, above the server's --max-lora-rank 4"):
        read_peft_adapter(str(adapter), hf_config, max_rank=4)
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        read_peft_adapter(str(tmp_path), hf_config, max_rank=16)
    other = {**hf_config, "hidden_size": hf_config["hidden_size"] * 2}
    with pytest.raises(AdapterError, match="trained for another base"):
        read_peft_adapter(str(adapter), other, max_rank=16)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    key = next(k for k in tensors if k.endswith("q_proj.lora_A.weight"))
    bad = _edit_config(adapter, tmp_path / "lm_head")
    save_file({**tensors, key.replace("layers.0.self_attn.q_proj", "lm_head").replace("model.model.", "model."):
               tensors[key].clone()}, str(bad / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="does not adapt: lm_head"):
        read_peft_adapter(str(bad), hf_config, max_rank=16)
    torn = _edit_config(adapter, tmp_path / "torn")
    (torn / "adapter_model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(AdapterError, match="cannot read the weights"):
        read_peft_adapter(str(torn), hf_config, max_rank=16)


def test_engine_refuses_before_queueing(tiny_llm, adapter):
    with pytest.raises(ValueError, match="serves no adapters"):
        tiny_llm.generate(["Hello"], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, str(adapter)))
    assert not tiny_llm.engine.core.scheduler.has_unfinished_requests()
