"""The store's CLI verbs in-process (create, list, show, cp, rm), and a pagoda-made model read back
as Ollama's layout."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pagoda.cli import main
from pagoda.store import manifests
from pagoda.store.layout import default_layout, parse_ref


def _modelfile(tmp_path: Path, gguf: Path, extra: str = "", name: str = "Modelfile") -> Path:
    path = tmp_path / name
    path.write_text(f"FROM {gguf}\n{extra}")
    return path


def _cli(capsys, *argv: str) -> str:
    code = main(list(argv))
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


def test_create_show_list(fresh_home, tiny_gguf, tmp_path, capsys):
    mf = _modelfile(tmp_path, tiny_gguf, 'PARAMETER temperature 0.3\nPARAMETER stop "<|im_end|>"\n'
                                         'SYSTEM """Be brief."""\nLICENSE MIT\n')
    assert "created tiny:latest (sha256:" in _cli(capsys, "create", "tiny", "-f", str(mf))
    shown = json.loads(_cli(capsys, "show", "tiny", "--json"))
    assert shown["model"]["architecture"] == "llama" and shown["model"]["quantization"] == "Q8_0"
    assert shown["model"]["context_length"] == 256 and shown["model"]["embedding_length"] == 64
    assert shown["parameters"] == {"temperature": 0.3, "stop": ["<|im_end|>"]}
    assert shown["system"] == "Be brief." and shown["license"] == ["MIT"]
    assert "<|im_start|>" in shown["gguf_chat_template"]
    kinds = [layer["media_type"].rsplit(".", 1)[-1] for layer in shown["layers"]]
    assert kinds == ["v1+json", "model", "system", "license", "params"]
    text = _cli(capsys, "show", "tiny", "--verify")
    assert "architecture        llama" in text and text.count("verified") == 5
    assert _cli(capsys, "show", "tiny", "--system").strip() == "Be brief."
    assert 'stop             "<|im_end|>"' in _cli(capsys, "show", "tiny", "--parameters")
    listing = _cli(capsys, "list")
    assert "tiny:latest" in listing and "CATALOG" in listing


def test_rm_keeps_blobs_another_model_uses(fresh_home, tiny_gguf, tmp_path, capsys):
    layout = default_layout()
    _cli(capsys, "create", "a", "-f", str(_modelfile(tmp_path, tiny_gguf, "SYSTEM one\n", "A")))
    _cli(capsys, "create", "b:v2", "-f", str(_modelfile(tmp_path, tiny_gguf, "SYSTEM two\n", "B")))
    _cli(capsys, "cp", "a", "alias-of-a")
    a = manifests.read_manifest(layout, parse_ref("a"))
    b = manifests.read_manifest(layout, parse_ref("b:v2"))
    assert a.layer(manifests.MODEL) == b.layer(manifests.MODEL)  # one GGUF blob, two models
    blob_count = len(list(layout.blobs_dir.iterdir()))
    assert blob_count == 5  # the model, two system layers, two configs

    assert "(0 blobs freed)" in _cli(capsys, "rm", "a")  # the copy still uses every blob of a
    out = _cli(capsys, "rm", "alias-of-a")
    assert "(2 blobs freed)" in out  # a's system layer and config; the model blob is b's too
    assert layout.blob_path(a.layer(manifests.MODEL).digest).is_file()
    assert not layout.blob_path(a.layer(manifests.SYSTEM).digest).exists()
    _cli(capsys, "rm", "b:v2")
    assert list(layout.blobs_dir.iterdir()) == [] and list(layout.manifests_dir.iterdir()) == []
    assert main(["rm", "b:v2"]) == 1 and "not found" in capsys.readouterr().err


def test_create_from_a_store_model_inherits_and_overrides(fresh_home, tiny_gguf, tmp_path, capsys):
    _cli(capsys, "create", "base", "-f", str(_modelfile(tmp_path, tiny_gguf,
                                                         "PARAMETER top_k 5\nPARAMETER num_ctx 64\nSYSTEM old\n")))
    (tmp_path / "Derived").write_text("FROM base\nPARAMETER num_ctx 32\nSYSTEM new\n")
    _cli(capsys, "create", "derived", "-f", str(tmp_path / "Derived"))
    shown = json.loads(_cli(capsys, "show", "derived", "--json"))
    assert shown["parameters"] == {"top_k": 5, "num_ctx": 32} and shown["system"] == "new"


def test_modelfile_errors_are_one_line_naming_the_line(fresh_home, tiny_gguf, tmp_path, capsys):
    mf = _modelfile(tmp_path, tiny_gguf, "PARAMETER temperature warm\n")
    assert main(["create", "bad", "-f", str(mf)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pagoda: error: ") and "line 2: PARAMETER temperature must be a number" in err
    (tmp_path / "Missing").write_text("FROM ./nope.gguf\n")
    assert main(["create", "bad", "-f", str(tmp_path / "Missing")]) == 1
    assert "line 1: FROM ./nope.gguf: no such file" in capsys.readouterr().err
    assert not default_layout().manifests_dir.exists()


def test_pagoda_made_model_is_ollamas_layout(fresh_home, tiny_gguf, tmp_path, capsys, monkeypatch):
    """Read the store with nothing of pagoda's: the paths, the manifest JSON and the blob names
    are Ollama's; then read it as Ollama's store (ollama:NAME)."""
    mf = _modelfile(tmp_path, tiny_gguf, 'TEMPLATE """{{ .Prompt }}"""\nPARAMETER stop "<|im_end|>"\n')
    _cli(capsys, "create", "mine:v1", "-f", str(mf))
    root = fresh_home / "store"
    manifest_path = root / "manifests" / "registry.ollama.ai" / "library" / "mine" / "v1"
    manifest = json.loads(manifest_path.read_bytes())
    assert manifest["schemaVersion"] == 2
    assert manifest["mediaType"] == "application/vnd.docker.distribution.manifest.v2+json"
    assert manifest["config"]["mediaType"] == "application/vnd.docker.container.image.v1+json"
    assert [x["mediaType"] for x in manifest["layers"]] == [
        "application/vnd.ollama.image.model", "application/vnd.ollama.image.template",
        "application/vnd.ollama.image.params"]
    for entry in [manifest["config"], *manifest["layers"]]:
        algo, hexdigest = entry["digest"].split(":")
        data = (root / "blobs" / f"{algo}-{hexdigest}").read_bytes()
        assert hashlib.sha256(data).hexdigest() == hexdigest and len(data) == entry["size"]
    assert (root / "blobs" / f"sha256-{hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()}").is_file()
    config = json.loads((root / "blobs" / manifest["config"]["digest"].replace(":", "-")).read_bytes())
    assert config["model_format"] == "gguf" and config["model_family"] == "llama"
    assert config["rootfs"]["diff_ids"] == [x["digest"] for x in manifest["layers"]]
    assert json.loads((root / "blobs" / manifest["layers"][2]["digest"].replace(":", "-")).read_bytes()) == {
        "stop": ["<|im_end|>"]}

    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    shown = json.loads(_cli(capsys, "show", "ollama:mine:v1", "--json"))
    assert shown["template"] == "{{ .Prompt }}" and shown["manifest_digest"] == "sha256:" + hashlib.sha256(
        manifest_path.read_bytes()).hexdigest()
    assert main(["rm", "ollama:mine:v1"]) == 1 and "does not delete from Ollama" in capsys.readouterr().err
