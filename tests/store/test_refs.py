"""Model references and the store's paths (Ollama's defaults and layout)."""

from __future__ import annotations

import pytest

from pagoda.store.layout import Ref, StoreLayout, digest_hex, parse_ref


@pytest.mark.parametrize("text, expected", [
    ("smollm2", Ref("registry.ollama.ai", "library", "smollm2", "latest")),
    ("smollm2:q4", Ref("registry.ollama.ai", "library", "smollm2", "q4")),
    ("alice/smollm2", Ref("registry.ollama.ai", "alice", "smollm2", "latest")),
    ("localhost:5000/library/smollm2:q4", Ref("localhost:5000", "library", "smollm2", "q4")),
    ("127.0.0.1:5000/smollm2:v1.2", Ref("127.0.0.1:5000", "library", "smollm2", "v1.2")),  # a host, as Docker reads it
    ("example.com/m", Ref("example.com", "library", "m", "latest")),
    ("localhost/m", Ref("localhost", "library", "m", "latest")),
    ("http://h:1/ns/m:t", Ref("h:1", "ns", "m", "t", scheme="http")),
])
def test_parse_ref_fills_ollamas_defaults(text, expected):
    assert parse_ref(text) == expected


def test_str_and_short():
    ref = parse_ref("smollm2")
    assert str(ref) == "registry.ollama.ai/library/smollm2:latest"
    assert ref.short() == "smollm2:latest"
    assert parse_ref("alice/m:t").short() == "alice/m:t"
    assert parse_ref("h:5000/ns/m:t").short() == "h:5000/ns/m:t"
    assert parse_ref("h:5000/ns/m:t").repository == "ns/m"


@pytest.mark.parametrize("text, words", [
    ("", "empty"),
    ("a/b/c/d", "too many"),
    ("m:", "empty tag"),
    ("-bad", "invalid name"),
    ("ns/.hidden", "invalid name"),
    ("m:bad tag", "invalid tag"),
    ("m@sha256:" + "0" * 64, "digest"),
    ("ftp://h/m", "unknown scheme"),
    ("bad_host!/ns/m", "invalid host"),
])
def test_bad_refs_say_what_is_wrong(text, words):
    with pytest.raises(ValueError, match=words):
        parse_ref(text)


def test_layout_paths(tmp_path):
    layout = StoreLayout(tmp_path)
    ref = parse_ref("h:5000/ns/m:t")
    assert layout.manifest_path(ref) == tmp_path / "manifests" / "h:5000" / "ns" / "m" / "t"
    digest = "sha256:" + "ab" * 32
    assert layout.blob_path(digest) == tmp_path / "blobs" / ("sha256-" + "ab" * 32)
    legacy = tmp_path / "blobs" / ("sha256:" + "ab" * 32)  # how Ollama named blobs before 0.1.30
    legacy.parent.mkdir(parents=True)
    legacy.write_bytes(b"x")
    assert layout.blob_path(digest) == legacy
    assert digest_hex("sha256-" + "ab" * 32) == "ab" * 32
    with pytest.raises(ValueError):
        digest_hex("md5:abc")
    assert layout.refs() == []
    layout.manifest_path(ref).parent.mkdir(parents=True)
    layout.manifest_path(ref).write_text("{}")
    assert layout.refs() == [Ref("h:5000", "ns", "m", "t")]


def test_store_lives_beside_the_catalog(monkeypatch, tmp_path):
    from pagoda.loader import catalog
    from pagoda.store.layout import store_root

    monkeypatch.setenv("PAGODA_HOME", str(tmp_path))
    assert store_root() == tmp_path / "store"
    assert catalog.models_root() == tmp_path / "models"
