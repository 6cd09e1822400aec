"""GGUF metadata → config.json (pagoda/loader/gguf_config.py): the config transformers reads for the
original model, rope scaling (linear, yarn, llama3's from rope_freqs), and an architecture pagoda
does not read named with those it does."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from gguf_export import export_gguf

from pagoda.loader.gguf_config import (
    SUPPORTED_ARCHITECTURES,
    _llama3_factors,
    _llama3_rope_scaling,
    gguf_to_hf_config,
)
from pagoda.loader.gguf_file import read_gguf
from pagoda.loader.gguf_model_dir import convert_gguf_metadata
from pagoda.loader.gguf_weights import iter_gguf_weights

ARCHS = ["llama", "qwen2", "qwen3"]  # the architectures of conftest.py's gguf_f32

CONFIG_FIELDS = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "max_position_embeddings", "vocab_size",
                 "tie_word_embeddings", "bos_token_id", "eos_token_id", "architectures", "model_type"]


@pytest.mark.parametrize("arch", ARCHS)
def test_config_matches_hf(arch, tiny_model_dirs, converted):
    import transformers

    original = transformers.AutoConfig.from_pretrained(tiny_model_dirs[arch])
    ours_json = json.loads((converted[arch] / "config.json").read_text())
    ours = transformers.AutoConfig.from_pretrained(converted[arch])
    original_head_dim = getattr(original, "head_dim", None) or original.hidden_size // original.num_attention_heads
    assert ours.head_dim == original_head_dim
    for field in CONFIG_FIELDS:
        assert getattr(ours, field) == getattr(original, field), field
    assert ours.rms_norm_eps == pytest.approx(original.rms_norm_eps)
    assert ours.rope_parameters["rope_theta"] == original.rope_parameters["rope_theta"]
    assert ours_json["rope_theta"] == original.rope_parameters["rope_theta"]
    assert ours_json["attention_bias"] is (arch == "qwen2")
    assert "rope_scaling" not in ours_json


def _rope_customizer(kind: gguf.RopeScalingType, factor: float, original: int | None = None):
    def customize(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(kind)
        writer.add_rope_scaling_factor(factor)
        if original is not None:
            writer.add_rope_scaling_orig_ctx_len(original)

    return customize


def test_rope_scaling_linear_and_yarn(tiny_model_dirs, tmp_path):
    linear = export_gguf(tiny_model_dirs["llama"], tmp_path / "linear.gguf",
                         customize=_rope_customizer(gguf.RopeScalingType.LINEAR, 2.0))
    config = gguf_to_hf_config(read_gguf(linear))
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert config["rope_parameters"] == {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}

    yarn = export_gguf(tiny_model_dirs["qwen2"], tmp_path / "yarn.gguf",
                       customize=_rope_customizer(gguf.RopeScalingType.YARN, 4.0, 32768))
    config = gguf_to_hf_config(read_gguf(yarn))
    assert config["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_llama3_rope_scaling_recovered_from_rope_freqs(factor):
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    rope_freqs = _llama3_factors(scaling, theta=500000.0, head_dim=64).astype(np.float32)  # as llama.cpp stores it
    assert _llama3_rope_scaling(rope_freqs, theta=500000.0, head_dim=64) == scaling


def test_unknown_architecture_lists_supported(tiny_model_dirs, tmp_path):
    path = export_gguf(tiny_model_dirs["llama"], tmp_path / "neox.gguf", architecture="gptneox")
    for call in (lambda: convert_gguf_metadata(path, tmp_path / "out"),
                 lambda: list(iter_gguf_weights(path, {"model_type": "llama"}))):
        with pytest.raises(ValueError, match="'gptneox' is not supported") as info:
            call()
        assert all(arch in str(info.value) for arch in SUPPORTED_ARCHITECTURES)
