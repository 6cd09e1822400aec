"""GGUF weights (pagoda/loader/gguf_weights.py): tiny HF models exported to GGUF (tests/gguf_export.py)
come back as the same weights, in every type pagoda writes and the K-quants it reads; a tensor of
a type or shape pagoda cannot load fails naming it."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_export import export_gguf, quantize_weight
from safetensors.torch import load_file

from pagoda.loader.gguf_config import gguf_to_hf_config
from pagoda.loader.gguf_file import read_gguf
from pagoda.loader.gguf_weights import iter_gguf_weights

ARCHS = ["llama", "qwen2", "qwen3"]  # the architectures of conftest.py's gguf_f32
# Worst error of a dequantized weight, as a fraction of the tensor's largest magnitude.
QUANT_TOLERANCE = {"F16": 1e-3, "BF16": 1e-2, "Q8_0": 1e-2, "Q5_0": 0.07, "Q4_0": 0.15, "Q4_1": 0.15}


def _hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(hf_dir / "model.safetensors"))


def _load(path: Path, config_dir: Path | None = None) -> dict[str, torch.Tensor]:
    config = gguf_to_hf_config(read_gguf(path)) if config_dir is None else json.loads(
        (config_dir / "config.json").read_text())
    return dict(iter_gguf_weights(path, config))


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_round_trip_is_exact(arch, tiny_model_dirs, gguf_f32):
    expected = _hf_weights(tiny_model_dirs[arch])
    got = _load(gguf_f32[arch])
    assert set(got) == set(expected)
    for name, want in expected.items():
        assert got[name].dtype == torch.float32
        assert got[name].shape == want.shape, name
        assert torch.equal(got[name], want), name


@pytest.mark.parametrize("qtype", list(QUANT_TOLERANCE))
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_round_trip(arch, qtype, tiny_model_dirs, tmp_path):
    expected = _hf_weights(tiny_model_dirs[arch])
    got = _load(export_gguf(tiny_model_dirs[arch], tmp_path / "model.gguf", qtype))
    assert set(got) == set(expected)
    for name, want in expected.items():
        if want.dim() == 1:  # norms and biases stay F32
            assert torch.equal(got[name], want), name
            continue
        stored = quantize_weight(want.numpy(), qtype)
        reference = torch.from_numpy(gguf.quants.dequantize(stored, GGMLQuantizationType[qtype]).astype(np.float32))
        assert torch.equal(got[name], reference.reshape(want.shape)), name
        error = (got[name] - want).abs().max().item()
        assert error <= QUANT_TOLERANCE[qtype] * want.abs().max().item(), (name, error)


def test_k_quants_cannot_be_exported(tiny_model_dirs, tmp_path):
    with pytest.raises(ValueError, match="Q4_K"):
        export_gguf(tiny_model_dirs["llama"], tmp_path / "model.gguf", "Q4_K")


def _write_synthetic_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType | None]]) -> None:
    """A minimal llama GGUF holding exactly ``tensors`` (raw storage arrays)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (data, raw_dtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _synthetic_config(hidden: int, vocab: int = 8) -> dict:
    return {"model_type": "llama", "hidden_size": hidden, "intermediate_size": hidden, "num_attention_heads": 1,
            "num_key_value_heads": 1, "num_hidden_layers": 1, "vocab_size": vocab}


def _random_k_blocks(qtype: GGMLQuantizationType, rows: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks with finite fp16 scales (random bytes there could be inf/NaN)."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, type_size), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.01, size=(rows, 2)).astype(np.float16).view(np.uint8)
    if qtype == GGMLQuantizationType.Q6_K:
        blocks[:, -2:] = scales[:, :2]  # d is the block's last field
    else:
        blocks[:, :4] = scales  # d, dmin lead the block
    return blocks


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_tensors_dequantize(qtype, tmp_path):
    """K-quants (256-wide blocks) load in the right shape and agree with transformers' own decoder."""
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    kind = GGMLQuantizationType[qtype]
    blocks = _random_k_blocks(kind, rows=8, rng=np.random.default_rng(0))
    path = tmp_path / "k.gguf"
    _write_synthetic_gguf(path, {"token_embd.weight": (blocks, kind)})
    (name, got), = iter_gguf_weights(path, _synthetic_config(hidden=256))
    assert name == "model.embed_tokens.weight" and got.shape == (8, 256)
    reference = hf_dequantize(torch.from_numpy(blocks), int(kind)).reshape(8, 256).float()
    assert torch.allclose(got, reference, rtol=0, atol=1e-6)


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path):
    path = tmp_path / "int.gguf"
    _write_synthetic_gguf(path, {
        "token_embd.weight": (np.zeros((8, 4), np.float32), None),
        "blk.0.attn_norm.weight": (np.zeros(4, np.int32), None),
    })
    with pytest.raises(ValueError, match=r"blk\.0\.attn_norm\.weight.*I32"):
        list(iter_gguf_weights(path, _synthetic_config(hidden=4)))


def test_shape_mismatch_with_config_is_an_error(gguf_f32):
    config = gguf_to_hf_config(read_gguf(gguf_f32["llama"])) | {"intermediate_size": 96}
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_\w+\.weight. has shape"):
        list(iter_gguf_weights(gguf_f32["llama"], config))


def test_tied_embeddings(tmp_path):
    from tiny_models import make_tiny_hf_model

    hf_dir = make_tiny_hf_model("qwen2", tmp_path / "tied", tie_word_embeddings=True)
    path = export_gguf(hf_dir, tmp_path / "tied.gguf")
    gf = read_gguf(path)
    assert "output.weight" not in gf.tensors
    config = gguf_to_hf_config(gf)
    assert config["tie_word_embeddings"] is True
    got = dict(iter_gguf_weights(path, config))
    assert "lm_head.weight" not in got
    assert torch.equal(got["model.embed_tokens.weight"], _hf_weights(hf_dir)["model.embed_tokens.weight"])


def test_untied_model_has_output_weight(gguf_f32):
    gf = read_gguf(gguf_f32["llama"])
    assert "output.weight" in gf.tensors
    assert gguf_to_hf_config(gf)["tie_word_embeddings"] is False
