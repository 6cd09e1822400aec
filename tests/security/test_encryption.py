"""Encrypted models at rest (`pagoda encrypt`: pagoda/security/encryption.py; the container and its
loading: pagoda/loader/encrypted_container.py, encrypted_model.py, model_keys.py): the container
round-trips the tiny Llama (safetensors directory and GGUF) to the plain model's greedy tokens,
weights never reach the disk, and a wrong key, a flipped byte, a truncated file or swapped chunks
are a ValueError at load, never output."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest
from gguf_export import export_gguf
from server_process import start_server, stop_process

from pagoda import LLM, SamplingParams
from pagoda.loader import gguf_model_dir
from pagoda.loader.resolve import resolve_model
from pagoda.loader import encrypted_container as container
from pagoda.loader import model_keys
from pagoda.security import encryption as enc

CHUNK = 64 * 1024  # the tiny models are ~0.5 MB: several chunks per weight file
GREEDY = SamplingParams(temperature=0, max_tokens=12)
PROMPTS = ["The quick brown fox", "def main():"]
ENGINE = dict(dtype="float32", kv_cache_memory=0.02)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("encrypted")


@pytest.fixture(scope="module")
def key_file(work) -> Path:
    return enc.generate_key_file(work / "model.key")


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama, work) -> Path:
    return export_gguf(tiny_llama, work / "tiny.gguf")


@pytest.fixture(scope="module")
def sealed_dir(tiny_llama, work, key_file) -> Path:
    return enc.encrypt_model(tiny_llama, work / "tiny-hf.pgenc", model_keys.load_key(key_file), chunk_size=CHUNK)


@pytest.fixture(scope="module")
def sealed_gguf(tiny_gguf, work, key_file) -> Path:
    return enc.encrypt_model(tiny_gguf, work / "tiny-gguf.pgenc", model_keys.load_key(key_file), chunk_size=CHUNK)


@pytest.fixture(scope="module")
def plain_tokens(tiny_llm) -> list[list[int]]:
    return _tokens(tiny_llm)


def _copy(path: Path, tmp_path: Path, name: str = "copy.pgenc") -> Path:
    out = tmp_path / name
    out.write_bytes(path.read_bytes())
    return out


def _weight_hashes(*paths: Path) -> dict[int, set[str]]:
    found: dict[int, set[str]] = {}
    for p in paths:
        data = p.read_bytes()
        found.setdefault(len(data), set()).add(hashlib.sha256(data).hexdigest())
    return found


def _plaintext_weights_under(roots: list[Path], weights: dict[int, set[str]]) -> list[Path]:
    """Files under ``roots`` named like weights, or holding a plain weight file's exact bytes."""
    hits = []
    for root in roots:
        for dirpath, _, names in os.walk(root):
            for name in names:
                p = Path(dirpath) / name
                try:
                    size = p.stat().st_size
                    if container.is_weight_member(name) or (
                            size in weights and hashlib.sha256(p.read_bytes()).hexdigest() in weights[size]):
                        hits.append(p)
                except OSError:
                    continue
    return hits


def _meta_dirs() -> set[Path]:
    found = set()
    for base in {Path("/dev/shm"), Path(tempfile.gettempdir())}:
        if base.is_dir():
            found |= set(base.glob("pagoda-model-meta-*"))
    return found


# -- round trips ------------------------------------------------------------------------------

def test_safetensors_container_serves_the_same_tokens_and_writes_no_weights(
        tiny_llama, sealed_dir, key_file, plain_tokens, tmp_path, monkeypatch):
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private_tmp))  # any temp file pagoda makes lands here
    before = set(sealed_dir.parent.iterdir())
    llm = LLM(model=str(sealed_dir), model_key_file=str(key_file), **ENGINE)
    try:
        assert _tokens(llm) == plain_tokens
        files = llm.engine.config.model.files
        meta = files.metadata_dir
        assert files.encryption is not None and files.format == "safetensors"
        assert stat.S_IMODE(meta.stat().st_mode) == 0o700
        assert sorted(p.name for p in meta.iterdir()) == sorted(
            p.name for p in tiny_llama.iterdir() if not p.name.endswith(".safetensors"))
        weights = _weight_hashes(*tiny_llama.glob("*.safetensors"))
        roots = [private_tmp, sealed_dir.parent, Path(os.environ["PAGODA_HOME"]), *_meta_dirs()]
        assert _plaintext_weights_under(roots, weights) == []
        assert set(sealed_dir.parent.iterdir()) == before
        # What goes to an engine process: the key file's path, never the key.
        pickled = pickle.dumps(llm.engine.config)
        secret = model_keys.load_key(key_file).secret
        assert secret not in pickled and secret.hex().encode() not in pickled
        assert pickle.loads(pickled).model.files.encryption.key_file == key_file.absolute()
    finally:
        llm.shutdown()


def test_gguf_container_serves_the_same_tokens(tiny_gguf, sealed_gguf, key_file, tmp_path, monkeypatch):
    plain = LLM(model=str(tiny_gguf), **ENGINE)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    sealed = LLM(model=str(sealed_gguf), model_key_file=str(key_file), **ENGINE)
    assert sealed.engine.config.model.files.format == "gguf"
    assert _tokens(sealed) == _tokens(plain)
    roots = [tmp_path, Path(os.environ["PAGODA_HOME"]) / "converted", *_meta_dirs()]
    assert _plaintext_weights_under(roots, _weight_hashes(tiny_gguf)) == []


def test_quantized_gguf_keeps_its_blocks_from_memory(tiny_llama, work, key_file):
    """--quantization gguf keeps the Q8_0 blocks as views of the decrypted (in-memory) mapping."""
    q8 = export_gguf(tiny_llama, work / "tiny-q8.gguf", "Q8_0")
    sealed = enc.encrypt_model(q8, work / "tiny-q8.pgenc", model_keys.load_key(key_file))
    plain = LLM(model=str(q8), quantization="gguf", **ENGINE)
    llm = LLM(model=str(sealed), model_key_file=str(key_file), quantization="gguf", **ENGINE)
    assert _tokens(llm) == _tokens(plain)


def test_a_store_name_is_encrypted_with_its_overlays(tiny_gguf, key_file, tmp_path, fresh_home, capsys):
    """`pagoda encrypt NAME` takes what --model NAME loads: a store model's GGUF (a sha256-named
    blob) with its overlays (here a shorter context and a system prompt)."""
    from pagoda.cli import main

    modelfile = tmp_path / "Modelfile"
    modelfile.write_text(f'FROM {tiny_gguf}\nPARAMETER num_ctx 128\nSYSTEM """Be brief."""\n')
    assert main(["create", "brief", "-f", str(modelfile)]) == 0, capsys.readouterr().err
    sealed = enc.encrypt_model("brief", tmp_path / "brief.pgenc", model_keys.load_key(key_file))
    with container.EncryptedModelReader(sealed, model_keys.load_key(key_file)) as reader:
        assert reader.members[-1].name == "model.gguf"
    files = resolve_model(str(sealed), key_file=str(key_file))
    assert files.hf_config()["max_position_embeddings"] == 128
    assert "Be brief." in (files.metadata_dir / "chat_template.jinja").read_text()
    plain, llm = LLM(model="brief", **ENGINE), LLM(model=str(sealed), model_key_file=str(key_file), **ENGINE)
    assert _tokens(llm) == _tokens(plain)


def test_key_from_the_environment(sealed_dir, key_file, plain_tokens, monkeypatch):
    monkeypatch.setenv("PAGODA_MODEL_KEY", key_file.read_text().strip())
    assert _tokens(LLM(model=str(sealed_dir), **ENGINE)) == plain_tokens


def test_passphrase_and_raw_key_files(tiny_llama, tmp_path):
    passphrase = tmp_path / "pass"
    passphrase.write_text("correct horse battery staple\n")
    raw = tmp_path / "raw"
    raw.write_bytes(bytes(range(200, 232)))
    for key_path, kdf in ((passphrase, "scrypt"), (raw, "none")):
        key = model_keys.load_key(key_path)
        out = enc.encrypt_model(tiny_llama, tmp_path / f"{kdf}.pgenc", key)
        assert container.container_summary(out, key)["kdf"] == kdf
        with container.EncryptedModelReader(out, key) as reader:
            config = reader.read_member(reader.member("config.json"))
        assert config == (tiny_llama / "config.json").read_bytes()
    with pytest.raises(ValueError, match="wrong key or corrupted/tampered.*passphrase"):
        container.EncryptedModelReader(tmp_path / "none.pgenc", model_keys.load_key(passphrase))


def test_gguf_metadata_converted_again_from_memory(tiny_gguf, sealed_gguf, key_file, tmp_path, monkeypatch):
    """A container made by an older GGUF converter: its metadata is converted again from the GGUF
    decrypted into memory (transformers reads it through /proc/self/fd)."""
    monkeypatch.setattr(gguf_model_dir, "_CONVERTER_VERSION", gguf_model_dir._CONVERTER_VERSION + 100)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    files = resolve_model(str(sealed_gguf), key_file=str(key_file))
    meta = files.metadata_dir
    assert json.loads((meta / "config.json").read_text())["model_type"] == "llama"
    assert (meta / "tokenizer.json").is_file()
    assert _plaintext_weights_under([tmp_path, meta], _weight_hashes(tiny_gguf)) == []


# -- failures -----------------------------------------------------------------------------------

def test_wrong_or_missing_key(sealed_dir, tmp_path, monkeypatch):
    wrong = enc.generate_key_file(tmp_path / "wrong.key")
    with pytest.raises(ValueError, match="wrong key or corrupted/tampered model file"):
        LLM(model=str(sealed_dir), model_key_file=str(wrong), **ENGINE)
    monkeypatch.delenv("PAGODA_MODEL_KEY", raising=False)
    with pytest.raises(ValueError, match="no key for the encrypted model"):
        resolve_model(str(sealed_dir))
    with pytest.raises(ValueError, match="model key file not found"):
        resolve_model(str(sealed_dir), key_file=str(tmp_path / "nope.key"))


def _chunk_offset(path: Path, key_file: Path, member: str, chunk: int) -> int:
    with container.EncryptedModelReader(path, model_keys.load_key(key_file)) as reader:
        m = reader.member(member)
        assert m.chunks > chunk
        return m.offset + chunk * (reader.chunk_size + container.TAG_SIZE)


def test_flipped_byte_in_a_weight_chunk_fails_the_load(sealed_dir, key_file, tmp_path):
    bad = _copy(sealed_dir, tmp_path)
    data = bytearray(bad.read_bytes())
    data[_chunk_offset(bad, key_file, "model.safetensors", 3) + 100] ^= 0x01
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"corrupted/tampered model file: chunk 3 of 'model.safetensors'"):
        LLM(model=str(bad), model_key_file=str(key_file), **ENGINE)


@pytest.mark.parametrize("where", ["magic", "header", "header_tag", "metadata", "last_tag"])
def test_any_flipped_byte_is_caught(sealed_dir, key_file, tmp_path, where):
    data = bytearray(sealed_dir.read_bytes())
    header_len = int.from_bytes(data[10:14], "big")
    offset = {"magic": 0, "header": 14 + header_len // 2, "header_tag": 14 + header_len + 3,
              "metadata": _chunk_offset(sealed_dir, key_file, "config.json", 0) + 5, "last_tag": len(data) - 1}[where]
    data[offset] ^= 0x80
    bad = tmp_path / "bad.pgenc"
    bad.write_bytes(bytes(data))
    key = model_keys.load_key(key_file)
    with pytest.raises(ValueError, match="not a pagoda encrypted model" if where == "magic" else "corrupted/tampered"):
        with container.EncryptedModelReader(bad, key) as reader:
            reader.verify()


def test_truncated_or_extended_file(sealed_dir, key_file, tmp_path):
    data = sealed_dir.read_bytes()
    for name, content, message in [("short", data[:-1], "truncated"), ("cut", data[: len(data) // 2], "truncated"),
                                   ("header", data[:20], "truncated inside its header"),
                                   ("long", data + b"\0", "trailing data")]:
        path = tmp_path / f"{name}.pgenc"
        path.write_bytes(content)
        with pytest.raises(ValueError, match=f"corrupted/tampered model file: {message}"):
            resolve_model(str(path), key_file=str(key_file))


def test_swapped_or_dropped_chunks(sealed_dir, key_file, tmp_path):
    data = bytearray(sealed_dir.read_bytes())
    size = CHUNK + container.TAG_SIZE
    a = _chunk_offset(sealed_dir, key_file, "model.safetensors", 1)
    b = _chunk_offset(sealed_dir, key_file, "model.safetensors", 2)
    swapped = bytearray(data)
    swapped[a:a + size], swapped[b:b + size] = data[b:b + size], data[a:a + size]
    key = model_keys.load_key(key_file)
    path = tmp_path / "swapped.pgenc"
    path.write_bytes(bytes(swapped))
    with pytest.raises(ValueError, match="chunk 1 of 'model.safetensors' does not authenticate"):
        container.EncryptedModelReader(path, key).verify()
    # A dropped chunk with a copy of another appended, so the length is still right.
    dropped = data[:a] + data[a + size:] + data[b:b + size]
    path.write_bytes(bytes(dropped))
    with pytest.raises(ValueError, match="wrong key or corrupted/tampered"):
        container.EncryptedModelReader(path, key).verify()


# -- the command line -----------------------------------------------------------------------------

def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagoda.cli", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_cli_keys_come_from_a_file_or_the_environment_never_the_command_line(tiny_llama, tmp_path):
    key = tmp_path / "k"
    done = _cli("encrypt", "--generate-key", str(key))
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_text().strip()) == 64
    assert _cli("encrypt", "--generate-key", str(key)).returncode == 1  # never overwrites a key

    out = tmp_path / "a.pgenc"
    done = _cli("encrypt", str(tiny_llama), "-o", str(out), "--key-file", str(key))
    assert done.returncode == 0, done.stderr
    assert container.is_encrypted_model(out)
    verified = _cli("encrypt", "--verify", str(out), "--key-file", str(key))
    assert verified.returncode == 0 and "every chunk authenticated" in verified.stdout
    assert "model.safetensors" in verified.stdout

    hex_key = key.read_text().strip()
    env_out = tmp_path / "b.pgenc"
    done = _cli("encrypt", str(tiny_llama), "-o", str(env_out), env={"PAGODA_MODEL_KEY": hex_key})
    assert done.returncode == 0, done.stderr
    done = _cli("encrypt", "--verify", str(env_out), "--key-env", "MY_KEY", env={"MY_KEY": hex_key})
    assert done.returncode == 0, done.stderr

    # The key as an argument value is refused (argparse: no such option; --key-env takes a name).
    nope = tmp_path / "c.pgenc"
    assert _cli("encrypt", str(tiny_llama), "-o", str(nope), "--key", hex_key).returncode == 2
    for value in (hex_key, "a" + hex_key[1:], "MY_UNSET_KEY_VAR"):
        refused = _cli("encrypt", str(tiny_llama), "-o", str(nope), "--key-env", value)
        assert refused.returncode == 1 and "takes the NAME of" in refused.stderr and value not in refused.stderr
    typed = _cli("encrypt", str(tiny_llama), "-o", str(nope), "--key-file", hex_key)
    assert typed.returncode == 1 and "looks like a key" in typed.stderr and hex_key not in typed.stderr
    wrong = _cli("encrypt", "--verify", str(out), env={"PAGODA_MODEL_KEY": "00" * 32})
    assert wrong.returncode == 1 and "wrong key or corrupted/tampered" in wrong.stderr
    assert not nope.exists()


def test_serve_with_engine_process_and_key_file(sealed_dir, key_file, tiny_llm, tmp_path):
    """`pagoda serve --engine-process --model-key-file`: the engine process reads the key itself;
    the metadata directory is private while serving and gone once the server exits."""
    before = _meta_dirs()
    proc, base = start_server(sealed_dir, "--model-key-file", str(key_file), "--engine-process")
    try:
        new = _meta_dirs() - before
        assert len(new) == 1 and stat.S_IMODE(next(iter(new)).stat().st_mode) == 0o700
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}
        got = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    finally:
        stop_process(proc)
    expected = tiny_llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].text
    assert got == expected
    assert _meta_dirs() - before == set()


def test_an_encrypted_models_repacked_weights_never_reach_the_disk(work, key_file):
    """A plain GGUF's super-block weights are kept repacked on disk between starts
    (loader/repacked_cache.py); an encrypted one's stay in memory."""
    from superblock_data import block_tensors
    from tiny_models import make_tiny_hf_model

    from pagoda.layers.superblocks import SuperBlockLinear
    from pagoda.loader.gguf_writer import write_gguf
    from pagoda.loader.gguf_writer_tensors import _hf_tensors

    hf = make_tiny_hf_model("llama", work / "hf-256", hidden_size=256, intermediate_size=512, head_dim=64,
                            tie_word_embeddings=True)
    path = write_gguf(hf, work / "tiny-q4k.gguf", "F32", tensors=block_tensors(_hf_tensors(hf), {"*": "Q4_K"}))
    sealed = enc.encrypt_model(path, work / "tiny-q4k.pgenc", model_keys.load_key(key_file))
    repacked = Path(os.environ["PAGODA_HOME"]) / "repacked"
    before = sorted(repacked.rglob("*")) if repacked.exists() else []
    llm = LLM(model=str(sealed), model_key_file=str(key_file), quantization="gguf", **ENGINE)
    assert any(isinstance(m, SuperBlockLinear) for m in llm.engine.core.model.modules())
    assert (sorted(repacked.rglob("*")) if repacked.exists() else []) == before
    plain = LLM(model=str(path), quantization="gguf", **ENGINE)
    assert _tokens(llm) == _tokens(plain)
    assert sorted(repacked.rglob("*.tiles"))  # the plain file's were kept
