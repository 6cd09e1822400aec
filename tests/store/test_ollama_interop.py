"""A store written by the test in Ollama's layout (plain JSON and sha256 files, nothing of pagoda's)
is loaded as `ollama:NAME` with its template, system and params layers applied."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from pagoda import LLM, SamplingParams

GO_CHATML = '''{{- range .Messages }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
'''
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def _blob(root: Path, data: bytes, media_type: str) -> dict:
    hexdigest = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / f"sha256-{hexdigest}").write_bytes(data)
    return {"mediaType": media_type, "digest": f"sha256:{hexdigest}", "size": len(data)}


def make_ollama_store(root: Path, gguf: Path, name: str, tag: str = "latest", *, template: str | None = None,
                      system: str | None = None, params: dict | None = None) -> None:
    layers = [_blob(root, gguf.read_bytes(), "application/vnd.ollama.image.model")]
    if template is not None:
        layers.append(_blob(root, template.encode(), "application/vnd.ollama.image.template"))
    if system is not None:
        layers.append(_blob(root, system.encode(), "application/vnd.ollama.image.system"))
    if params is not None:
        layers.append(_blob(root, json.dumps(params).encode(), "application/vnd.ollama.image.params"))
    config = _blob(root, json.dumps({"model_format": "gguf", "model_family": "llama", "rootfs": {
        "type": "layers", "diff_ids": [x["digest"] for x in layers]}}).encode(),
        "application/vnd.docker.container.image.v1+json")
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": config, "layers": layers}
    path = root / "manifests" / "registry.ollama.ai" / "library" / name / tag
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def reference_output(tiny_gguf) -> str:
    llm = LLM(model=str(tiny_gguf), dtype="float32", kv_cache_memory=0.01)
    return llm.generate(["The store"], GREEDY, use_tqdm=False)[0].outputs[0].text


def test_ollama_store_model_loads_with_its_layers(tiny_gguf, reference_output, tmp_path, monkeypatch):
    root = tmp_path / "ollama-models"
    make_ollama_store(root, tiny_gguf, "tiny", system="You are a test.",
                      params={"num_ctx": 128, "stop": ["<|im_end|>", "not one token"], "temperature": 0.1})
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    llm = LLM(model="ollama:tiny", dtype="float32", kv_cache_memory=0.01)
    config = llm.engine.config.model
    assert config.max_model_len == 128  # num_ctx (the GGUF says 256)
    assert config.files.gguf_file == root / "blobs" / f"sha256-{hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()}"
    tok = llm.get_tokenizer()
    im_end = tok.token_to_id("<|im_end|>")
    assert im_end in tok.eos_token_ids  # a single-token stop became an end-of-sequence id
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt.startswith("<|im_start|>system\nYou are a test.<|im_end|>")  # the system layer
    own = tok.apply_chat_template([{"role": "system", "content": "Mine."}, {"role": "user", "content": "hi"}])
    assert "You are a test." not in own and "Mine." in own
    assert llm.generate(["The store"], GREEDY, use_tqdm=False)[0].outputs[0].text == reference_output
    generation = json.loads((config.files.metadata_dir / "generation_config.json").read_text())
    assert generation["temperature"] == 0.1  # recorded (the engine does not take defaults from it yet)


def test_go_template_is_used_when_the_gguf_has_none(tiny_gguf, tmp_path, monkeypatch):
    """The GGUF's own Jinja template wins; a GGUF without one gets the TEMPLATE layer converted."""
    import gguf

    from pagoda.store.load import overlay_contents

    reader = gguf.GGUFReader(str(tiny_gguf))
    assert reader.fields.get("tokenizer.chat_template") is not None
    from pagoda.loader.gguf_model_dir import load_gguf_model_dir

    meta = load_gguf_model_dir(tiny_gguf)
    assert overlay_contents(meta, {}, None, GO_CHATML) == {}  # the GGUF's template is kept
    bare = tmp_path / "meta"
    bare.mkdir()
    for f in meta.iterdir():
        (bare / f.name).write_bytes(f.read_bytes())
    tok_config = json.loads((bare / "tokenizer_config.json").read_text())
    del tok_config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(tok_config))
    changed = overlay_contents(bare, {}, None, GO_CHATML)
    from pagoda.tokenizer import _compile_template

    rendered = _compile_template(changed["chat_template.jinja"]).render(
        messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_missing_ollama_model_is_a_clear_error(tmp_path, monkeypatch):
    from pagoda.loader.resolve import resolve_model

    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    with pytest.raises(ValueError, match="not found in Ollama's store"):
        resolve_model("ollama:nothing:here")
