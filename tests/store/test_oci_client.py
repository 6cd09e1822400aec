"""Push and pull against a real OCI registry (the CNCF distribution registry, started by the
fixture on 127.0.0.1): round trip with the same digests and the same greedy output, chunked
upload, existence check and cross-repository mount, an interrupted pull resumed with Range, a
corrupted blob rejected, basic auth (htpasswd) and bearer tokens, two pulls at once."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from pagoda import LLM, SamplingParams
from pagoda.store import blobs, create, manifests, oci_client
from pagoda.store.layout import StoreLayout, default_layout, parse_ref
from pagoda.store.modelfile import parse_modelfile

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def _make_model(gguf: Path, name: str) -> manifests.Manifest:
    mf = parse_modelfile(f'FROM {gguf}\nPARAMETER num_ctx 200\nPARAMETER stop "<|im_end|>"\nSYSTEM Be kind.\n')
    return create.create_model(name, mf)[1]


def _digests(manifest: manifests.Manifest) -> list[str]:
    return [layer.digest for layer in manifest.blobs()]


def _empty_store(fresh_home: Path, monkeypatch, name: str) -> StoreLayout:
    """Switch `$PAGODA_HOME` to another home with an empty store (same kernels and conversions)."""
    home = fresh_home.parent / name
    home.mkdir()
    for entry in fresh_home.iterdir():
        if entry.is_symlink():
            (home / entry.name).symlink_to(os.readlink(entry), target_is_directory=True)
    monkeypatch.setenv("PAGODA_HOME", str(home))
    return default_layout()


def test_push_then_pull_gives_the_same_digests_and_output(registry, fresh_home, tiny_gguf, monkeypatch):
    ref = parse_ref(f"{registry.host}/library/tiny:q8")
    pushed = _make_model(tiny_gguf, str(ref))
    local = LLM(model=str(ref), dtype="float32", kv_cache_memory=0.01)
    expected = local.generate(["Registries"], GREEDY, use_tqdm=False)[0].outputs[0].text
    del local

    stats = registry_push(ref, chunk_size=32 << 10)  # several PATCHes for the model blob
    assert set(stats.actions.values()) == {"uploaded"} and len(stats.actions) == 4
    assert stats.manifest_digest == pushed.digest
    assert set(registry_push(ref).actions.values()) == {"existed"}  # HEAD says the registry has them
    other = parse_ref(f"{registry.host}/someone/tiny:1")
    create.copy_model(str(ref), str(other))
    assert set(registry_push(other).actions.values()) == {"mounted"}  # cross-repository mount

    layout = _empty_store(fresh_home, monkeypatch, "puller")
    stats = registry_pull(layout, ref)
    assert set(stats.actions.values()) == {"downloaded"}
    pulled = manifests.read_manifest(layout, ref)
    assert pulled.digest == pushed.digest and _digests(pulled) == _digests(pushed)
    assert all(blobs.verify_blob(layout, d) for d in _digests(pulled))
    assert set(registry_pull(layout, ref).actions.values()) == {"existed"}  # nothing fetched twice
    llm = LLM(model=str(ref), dtype="float32", kv_cache_memory=0.01)
    assert llm.engine.config.model.max_model_len == 200
    assert llm.generate(["Registries"], GREEDY, use_tqdm=False)[0].outputs[0].text == expected


def registry_push(ref, **kwargs):
    return oci_client.push(default_layout(), ref, insecure=True, **kwargs)


def registry_pull(layout, ref, **kwargs):
    return oci_client.pull(layout, ref, insecure=True, **kwargs)


def _push_through(proxy, gguf: Path, name: str) -> tuple[parse_ref, manifests.Manifest]:
    ref = parse_ref(f"{proxy.host}/library/{name}")
    manifest = _make_model(gguf, str(ref))
    registry_push(ref)
    return ref, manifest


def test_interrupted_pull_resumes_with_range(proxy, fresh_home, tiny_gguf, monkeypatch):
    ref, manifest = _push_through(proxy, tiny_gguf, "resume:1")
    model = manifest.layer(manifests.MODEL)
    layout = _empty_store(fresh_home, monkeypatch, "puller")
    proxy.cut_blob_after = 50_000
    with pytest.raises(oci_client.RegistryError, match="interrupted at byte .* pull again to resume"):
        registry_pull(layout, ref, retries=0)
    partial = layout.blobs_dir / f"sha256-{model.digest.split(':')[1]}-partial"
    have = partial.stat().st_size
    assert 0 < have < model.size and not blobs.has_blob(layout, model.digest)
    assert manifests.read_manifest(layout, ref) is None  # no model until every blob is in
    proxy.requests.clear()
    stats = registry_pull(layout, ref)
    assert stats.resumed_from == {model.digest: have}
    ranges = [h.get("Range") for method, path, h in proxy.requests if method == "GET" and model.digest in path]
    assert ranges == [f"bytes={have}-"]
    assert blobs.verify_blob(layout, model.digest) and not partial.exists()

    # The same within one pull: the connection drops, the client resumes by itself.
    layout = _empty_store(fresh_home, monkeypatch, "puller2")
    proxy.cut_blob_after = 70_000
    stats = registry_pull(layout, ref)
    assert stats.resumed_from[model.digest] > 0
    assert manifests.read_manifest(layout, ref).digest == manifest.digest


def test_corrupted_blob_is_rejected(registry, fresh_home, tiny_gguf, monkeypatch):
    ref = parse_ref(f"{registry.host}/library/corrupt:1")
    manifest = _make_model(tiny_gguf, str(ref))
    registry_push(ref)
    model = manifest.layer(manifests.MODEL)
    data_path = registry.blob_data_path(model.digest)
    original = data_path.read_bytes()
    data = bytearray(original)
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped: only the digest can tell
    data_path.write_bytes(bytes(data))
    layout = _empty_store(fresh_home, monkeypatch, "puller")
    try:
        with pytest.raises(blobs.DigestMismatch, match="rejected"):
            registry_pull(layout, ref)
    finally:
        data_path.write_bytes(original)  # the registry is shared by this module's tests
    assert not blobs.has_blob(layout, model.digest)
    assert [p.name for p in layout.blobs_dir.iterdir() if model.digest.split(":")[1] in p.name] == []
    assert manifests.read_manifest(layout, ref) is None


def test_basic_auth(auth_registry, fresh_home, tiny_gguf, monkeypatch):
    ref = parse_ref(f"{auth_registry.host}/library/private:1")
    manifest = _make_model(tiny_gguf, str(ref))
    monkeypatch.delenv("PAGODA_REGISTRY_USERNAME", raising=False)
    with pytest.raises(oci_client.RegistryError, match="PAGODA_REGISTRY_USERNAME"):
        registry_push(ref)
    monkeypatch.setenv("PAGODA_REGISTRY_USERNAME", "alice")
    monkeypatch.setenv("PAGODA_REGISTRY_PASSWORD", "wrong")
    with pytest.raises(oci_client.RegistryError, match="refused the credentials"):
        registry_push(ref)
    monkeypatch.setenv("PAGODA_REGISTRY_PASSWORD", "s3cret")
    assert registry_push(ref).manifest_digest == manifest.digest
    layout = _empty_store(fresh_home, monkeypatch, "puller")
    assert registry_pull(layout, ref).manifest_digest == manifest.digest


def test_bearer_token(proxy, fresh_home, tiny_gguf, monkeypatch):
    proxy.bearer = "tok-123"
    monkeypatch.setenv("PAGODA_REGISTRY_USERNAME", "alice")
    monkeypatch.setenv("PAGODA_REGISTRY_PASSWORD", "s3cret")
    ref, manifest = _push_through(proxy, tiny_gguf, "token:1")
    token_requests = [path for method, path, h in proxy.requests if path.startswith("/token")]
    assert {method for method, *_ in proxy.requests} >= {"HEAD", "POST", "PATCH", "PUT"}  # all authorized
    assert token_requests and "service=test" in token_requests[0] and "scope=repository" in token_requests[0]
    layout = _empty_store(fresh_home, monkeypatch, "puller")
    assert registry_pull(layout, ref).manifest_digest == manifest.digest
    monkeypatch.setenv("PAGODA_REGISTRY_PASSWORD", "nope")
    with pytest.raises(oci_client.RegistryError, match="token request .* 401"):
        registry_pull(_empty_store(fresh_home, monkeypatch, "puller2"), ref)


def test_two_pulls_of_one_model_at_once(registry, fresh_home, tiny_gguf, monkeypatch):
    ref = parse_ref(f"{registry.host}/library/twice:1")
    manifest = _make_model(tiny_gguf, str(ref))
    registry_push(ref)
    layout = _empty_store(fresh_home, monkeypatch, "puller")
    results, errors = [], []
    barrier = threading.Barrier(2)

    def pull():
        try:
            barrier.wait()
            results.append(registry_pull(layout, ref))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=pull) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and len(results) == 2
    assert all(blobs.verify_blob(layout, d) for d in _digests(manifest))
    assert sorted(p.name for p in layout.blobs_dir.iterdir()) == sorted(
        f"sha256-{d.split(':')[1]}" for d in _digests(manifest))  # no partial left behind
    assert manifests.read_manifest(layout, ref).digest == manifest.digest


def test_cli_push_pull_and_errors(registry, fresh_home, tiny_gguf, monkeypatch, capsys):
    from pagoda.cli import main

    ref = f"{registry.host}/library/cli:1"
    manifest = _make_model(tiny_gguf, ref)
    assert main(["push", ref, "--insecure"]) == 0
    assert capsys.readouterr().out.strip() == manifest.digest
    _empty_store(fresh_home, monkeypatch, "puller")
    assert main(["pull", ref, "--insecure"]) == 0
    assert capsys.readouterr().out.strip() == manifest.digest
    assert main(["pull", f"{registry.host}/library/absent:1", "--insecure"]) == 1
    assert "not found" in capsys.readouterr().err
    assert main(["push", "nowhere:1", "--insecure"]) == 1
    assert "not found in the store" in capsys.readouterr().err
