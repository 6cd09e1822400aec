"""GGUF loader: tiny HF models exported to GGUF (tests/gguf_export.py) come back as the same weights,
config and tokenizer; bad files fail with clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_export import export_gguf, quantize_weight
from safetensors.torch import load_file

from pagoda.loader.gguf import (
    SUPPORTED_ARCHITECTURES,
    _llama3_factors,
    _llama3_rope_scaling,
    convert_gguf_metadata,
    gguf_to_hf_config,
    iter_gguf_weights,
    load_gguf_model_dir,
    read_gguf,
)

ARCHS = ["llama", "qwen2", "qwen3"]
# Worst error of a dequantized weight, as a fraction of the tensor's largest magnitude.
QUANT_TOLERANCE = {"F16": 1e-3, "BF16": 1e-2, "Q8_0": 1e-2, "Q5_0": 0.07, "Q4_0": 0.15, "Q4_1": 0.15}
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "In 1492, numbers like 3.14159 and 2718 appear; 1234567890",
    "你好，世界。机器学习很有趣！",
    "Emoji: 😀🚀🎉 and a family 👨‍👩‍👧",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "  leading spaces\tand\ttabs\n\nnewlines  ",
]


@pytest.fixture(scope="module")
def gguf_f32(tiny_model_dirs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf_f32")
    return {arch: export_gguf(tiny_model_dirs[arch], root / f"{arch}.gguf") for arch in ARCHS}


@pytest.fixture(scope="module")
def converted(gguf_f32, tmp_path_factory) -> dict[str, Path]:
    """convert_gguf_metadata output per architecture (imports transformers once, for the tokenizer)."""
    root = tmp_path_factory.mktemp("converted")
    return {arch: convert_gguf_metadata(path, root / arch) for arch, path in gguf_f32.items()}


def _hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(hf_dir / "model.safetensors"))


def _load(path: Path, config_dir: Path | None = None) -> dict[str, torch.Tensor]:
    config = gguf_to_hf_config(read_gguf(path)) if config_dir is None else json.loads(
        (config_dir / "config.json").read_text())
    return dict(iter_gguf_weights(path, config))


# --- weights ------------------------------------------------------------------------------------


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


# --- metadata ------------------------------------------------------------------------------------


def test_reader_matches_gguf_reader(gguf_f32):
    """Our fast parser reads the same metadata and tensor table as gguf.GGUFReader."""
    ours = read_gguf(gguf_f32["qwen3"])
    reference = gguf.GGUFReader(gguf_f32["qwen3"])
    for key, field in reference.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        assert ours.metadata[key] == (pytest.approx(value, rel=1e-6) if isinstance(value, float) else value), key
    assert [t.name for t in reference.tensors] == list(ours.tensors)
    for t in reference.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(reversed(t.shape.tolist())) and info.ggml_type == t.tensor_type
        assert np.array_equal(ours.stored_array(info).reshape(-1), np.asarray(t.data).reshape(-1))


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


def test_generation_config(converted):
    generation = json.loads((converted["llama"] / "generation_config.json").read_text())
    assert generation["bos_token_id"] == 1
    # eos (<|im_end|>) first; llama.cpp also stops on the control token <|endoftext|>.
    assert generation["eos_token_id"] == [2, 0]


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_encodes_like_original(arch, tiny_model_dirs, converted):
    from tokenizers import Tokenizer

    original = Tokenizer.from_file(str(tiny_model_dirs[arch] / "tokenizer.json"))
    ours = Tokenizer.from_file(str(converted[arch] / "tokenizer.json"))
    for text in TEXTS:
        want = original.encode(text).ids
        assert ours.encode(text).ids == want, text
        assert ours.decode(want, skip_special_tokens=False) == original.decode(want, skip_special_tokens=False)
    assert ours.encode("<|im_start|>").ids == [1]


def test_tokenizer_config(tiny_model_dirs, converted):
    original = json.loads((tiny_model_dirs["llama"] / "tokenizer_config.json").read_text())
    ours = json.loads((converted["llama"] / "tokenizer_config.json").read_text())
    for key in ("bos_token", "eos_token", "pad_token", "add_bos_token", "chat_template"):
        assert ours[key] == original[key], key


def test_transformers_loads_converted_tokenizer(converted):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(converted["qwen2"])
    assert tok.eos_token == "<|im_end|>"
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


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


# --- errors --------------------------------------------------------------------------------------


def test_truncated_file_is_a_clear_error(gguf_f32, tmp_path):
    data = gguf_f32["llama"].read_bytes()
    for name, cut in [("half", len(data) // 2), ("header", 100)]:
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="is truncated"):
            read_gguf(path)
        with pytest.raises(ValueError, match="is truncated"):
            list(iter_gguf_weights(path, {"model_type": "llama"}))
        with pytest.raises(ValueError, match="is truncated"):
            convert_gguf_metadata(path, tmp_path / f"out-{name}")


def test_not_a_gguf_file(tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match="not a valid GGUF file"):
        read_gguf(garbage)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="not a valid GGUF file"):
        read_gguf(empty)


def test_unknown_architecture_lists_supported(tiny_model_dirs, tmp_path):
    path = export_gguf(tiny_model_dirs["llama"], tmp_path / "neox.gguf", architecture="gptneox")
    for call in (lambda: convert_gguf_metadata(path, tmp_path / "out"),
                 lambda: list(iter_gguf_weights(path, {"model_type": "llama"}))):
        with pytest.raises(ValueError, match="'gptneox' is not supported") as info:
            call()
        assert all(arch in str(info.value) for arch in SUPPORTED_ARCHITECTURES)


# --- cache ---------------------------------------------------------------------------------------


def test_load_gguf_model_dir_caches(gguf_f32, tmp_path, monkeypatch):
    import pagoda.loader.gguf as gguf_loader

    monkeypatch.setenv("PAGODA_HOME", str(tmp_path / "home"))
    model = tmp_path / "model.gguf"
    model.write_bytes(gguf_f32["llama"].read_bytes())
    first = load_gguf_model_dir(model)
    assert first.parent == tmp_path / "home" / "converted"
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {
        p.name for p in first.iterdir()}
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp dir left behind

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_loader, "convert_gguf_metadata", no_conversion)
    assert load_gguf_model_dir(model) == first

    os.utime(model, ns=(1, 1))  # a changed file gets a fresh conversion
    with pytest.raises(AssertionError, match="converted twice"):
        load_gguf_model_dir(model)


_CACHED_LOAD_SCRIPT = """
import json, sys
from pathlib import Path
from pagoda.loader.gguf import iter_gguf_weights, load_gguf_model_dir
already = "transformers" in sys.modules
model_dir = load_gguf_model_dir(Path(sys.argv[1]))
config = json.loads((model_dir / "config.json").read_text())
assert sum(1 for _ in iter_gguf_weights(Path(sys.argv[1]), config)) > 0
assert already or "transformers" not in sys.modules, "a cached load imported transformers"
"""


def test_cached_load_does_not_import_transformers(gguf_f32, tmp_path):
    env = dict(os.environ, PAGODA_HOME=str(tmp_path / "home"))
    path = str(gguf_f32["qwen3"])
    warm = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                           "from pagoda.loader.gguf import load_gguf_model_dir; load_gguf_model_dir(Path(sys.argv[1]))",
                           path], env=env, capture_output=True, text=True)
    assert warm.returncode == 0, warm.stderr
    cached = subprocess.run([sys.executable, "-c", _CACHED_LOAD_SCRIPT, path], env=env, capture_output=True, text=True)
    assert cached.returncode == 0, cached.stderr
