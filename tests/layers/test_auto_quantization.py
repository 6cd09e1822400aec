"""``--quantization auto``, the default: a GGUF runs on its own blocks (in float32), an HF checkpoint
in int8, and a dtype the user names turns it off; the start-up log says what was picked and why."""

from __future__ import annotations

import logging

import pytest
import torch
from gguf_export import export_gguf

from pagoda.config import EngineArgs, create_engine_config
from pagoda.layers.auto_quantization import choose_quantization
from pagoda.layers.cpu_kernels import load_cpu_kernels

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(("requested", "fmt", "device", "dtype", "mode"), [
    (None, "gguf", CPU, "auto", "gguf"),
    ("auto", "gguf", CPU, "auto", "gguf"),
    (None, "safetensors", CPU, "auto", "int8"),
    (None, "gguf", CPU, "float32", None),          # exact transformers parity, one flag away
    (None, "safetensors", CPU, "bfloat16", None),
    (None, "gguf", CUDA, "auto", None),            # the quantized modes are the CPU kernels'
    ("none", "gguf", CPU, "auto", "none"),         # asked for: returned as it is, for the checks
    ("int4", "safetensors", CPU, "float32", "int4"),
])
def test_what_auto_picks(requested, fmt, device, dtype, mode):
    assert choose_quantization(requested, fmt, device, dtype)[0] == mode


def _config(model, caplog, **kwargs):
    with caplog.at_level(logging.INFO, logger="pagoda.layers.auto_quantization"):
        config = create_engine_config(EngineArgs(model=str(model), **kwargs))
    return config.model, caplog.text


def test_the_default_reaches_the_model_config_and_is_said(tiny_llama, tmp_path, caplog):
    gguf = export_gguf(tiny_llama, tmp_path / "tiny-q4_0.gguf", "Q4_0")
    model, said = _config(gguf, caplog)
    assert (model.quantization, model.dtype) == ("gguf", torch.float32)
    assert "quantization: gguf (auto: a GGUF runs on its own quantized blocks" in said
    caplog.clear()
    model, said = _config(tiny_llama, caplog)
    assert model.quantization == "int8" and "quantization: int8 (auto: Q8_0 blocks" in said
    caplog.clear()
    model, said = _config(gguf, caplog, dtype="float32")
    assert model.quantization is None and "quantization: none (auto: --dtype float32" in said
    model, _ = _config(gguf, caplog, quantization="none")
    assert model.quantization is None


@pytest.mark.skipif(load_cpu_kernels() is None, reason="pagoda's C++ kernels cannot be built here")
def test_an_engine_left_to_the_default_runs_the_blocks(tiny_llama, tmp_path):
    from pagoda import LLM, SamplingParams
    from pagoda.layers.ggml_blocks import BlockLinear

    gguf = export_gguf(tiny_llama, tmp_path / "tiny-q8_0.gguf", "Q8_0")
    for model in (gguf, tiny_llama):
        llm = LLM(str(model), kv_cache_memory=0.02)
        blocks = [m for m in llm.engine.core.model.modules() if isinstance(m, BlockLinear)]
        assert len(blocks) == 2 * 4 + 1  # every projection of both layers, and the head
        assert len(llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].token_ids) == 4
