"""Manifests: which blobs make a model, and the config blob that describes it.

The manifest is the JSON Ollama writes (an image manifest, schema 2, with Docker's v2 media
type, as Ollama's registry serves; the OCI media type is accepted on read, the two shapes are
the same)::

    {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
     "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": ..., "size": ...},
     "layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": ..., "size": ...}, ...]}

Layer media types: model (the GGUF), template, system, params (JSON), license, messages.
A manifest is stored with the exact bytes it was pushed or pulled with, so its digest is stable.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from pagoda.store.blobs import digest_bytes, has_blob, write_blob
from pagoda.store.layout import Ref, StoreLayout, digest_hex

DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MANIFEST_TYPES = (DOCKER_MANIFEST, OCI_MANIFEST)
# The OCI distribution spec lets a registry refuse manifests over 4 MiB; a model's is a few hundred
# bytes, so anything bigger (pulled, or found in the store) is refused unread.
MAX_MANIFEST_BYTES = 4 << 20
CONFIG = "application/vnd.docker.container.image.v1+json"

MODEL = "application/vnd.ollama.image.model"
TEMPLATE = "application/vnd.ollama.image.template"
SYSTEM = "application/vnd.ollama.image.system"
PARAMS = "application/vnd.ollama.image.params"
LICENSE = "application/vnd.ollama.image.license"
MESSAGES = "application/vnd.ollama.image.messages"
ADAPTER = "application/vnd.ollama.image.adapter"
PROJECTOR = "application/vnd.ollama.image.projector"


@dataclass(frozen=True)
class Layer:
    media_type: str
    digest: str
    size: int

    def to_json(self) -> dict:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size}

    @classmethod
    def from_json(cls, obj: dict) -> Layer:
        try:
            layer = cls(str(obj["mediaType"]), str(obj["digest"]), int(obj["size"]))
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"manifest entry without mediaType / digest / size: {obj!r}") from None
        digest_hex(layer.digest)  # a sha256 digest, or ValueError
        return layer


@dataclass
class Manifest:
    config: Layer
    layers: list[Layer]
    media_type: str = DOCKER_MANIFEST
    raw: bytes | None = field(default=None, repr=False)  # the bytes as stored / received

    def to_bytes(self) -> bytes:
        if self.raw is not None:
            return self.raw
        return json.dumps({
            "schemaVersion": 2,
            "mediaType": self.media_type,
            "config": self.config.to_json(),
            "layers": [layer.to_json() for layer in self.layers],
        }, separators=(",", ":")).encode()

    @property
    def digest(self) -> str:

        return digest_bytes(self.to_bytes())

    def blobs(self) -> list[Layer]:
        return [self.config, *self.layers]

    def layer(self, media_type: str) -> Layer | None:
        return next((layer for layer in self.layers if layer.media_type == media_type), None)

    def layers_of(self, media_type: str) -> list[Layer]:
        return [layer for layer in self.layers if layer.media_type == media_type]

    @property
    def total_size(self) -> int:
        return sum(layer.size for layer in self.blobs())


def parse_manifest(data: bytes) -> Manifest:
    try:
        obj = json.loads(data)
    except ValueError as e:
        raise ValueError(f"manifest is not JSON: {e}") from None
    if not isinstance(obj, dict) or obj.get("schemaVersion") != 2 or "config" not in obj:
        raise ValueError("not an image manifest (schemaVersion 2 with a config)")
    media_type = obj.get("mediaType") or OCI_MANIFEST
    if media_type not in MANIFEST_TYPES:
        raise ValueError(f"unsupported manifest media type {media_type!r}")
    return Manifest(Layer.from_json(obj["config"]), [Layer.from_json(x) for x in obj.get("layers") or []],
                    media_type, raw=bytes(data))


def read_manifest(layout: StoreLayout, ref: Ref) -> Manifest | None:
    path = layout.manifest_path(ref)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    if len(data) > MAX_MANIFEST_BYTES:
        raise ValueError(f"{path}: a manifest over {MAX_MANIFEST_BYTES} bytes: not read")
    try:
        return parse_manifest(data)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def write_manifest(layout: StoreLayout, ref: Ref, manifest: Manifest) -> Path:
    """Write atomically, after checking every blob it names is present."""

    layout.check_writable()
    missing = [layer.digest for layer in manifest.blobs() if not has_blob(layout, layer.digest)]
    if missing:
        raise ValueError(f"cannot write the manifest of {ref}: blobs missing from the store: {', '.join(missing)}")
    path = layout.manifest_path(ref)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        f.write(manifest.to_bytes())
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path


def referenced_digests(layout: StoreLayout) -> set[str]:
    """The hex digests of every blob some manifest in the store names."""
    used = set()
    for ref in layout.refs():
        try:
            manifest = read_manifest(layout, ref)
        except ValueError:
            continue  # an unreadable manifest protects nothing, and is not ours to delete
        if manifest is not None:
            used.update(digest_hex(layer.digest) for layer in manifest.blobs())
    return used


def remove_manifest(layout: StoreLayout, ref: Ref) -> list[str]:
    """Delete ``ref``'s manifest, then those of its blobs no other manifest names (blobs other
    models share stay). Returns the digests deleted. ValueError if there is no such model."""
    layout.check_writable()
    manifest = read_manifest(layout, ref)
    if manifest is None:
        raise ValueError(f"model {ref.short()!r} not found in {layout.root}")
    path = layout.manifest_path(ref)
    path.unlink()
    # Drop directories left empty (tag's parents up to manifests/).
    parent = path.parent
    while parent != layout.manifests_dir and parent.is_relative_to(layout.manifests_dir):
        try:
            parent.rmdir()
        except OSError:
            break
        parent = parent.parent
    used = referenced_digests(layout)
    removed = []
    for layer in manifest.blobs():
        hexdigest = digest_hex(layer.digest)
        if hexdigest in used or layer.digest in removed:
            continue
        with contextlib.suppress(FileNotFoundError):
            layout.blob_path(layer.digest).unlink()
            removed.append(layer.digest)
    return removed


def make_config(layers: list[Layer], info: dict | None = None) -> bytes:
    """The config blob Ollama writes (its ``ConfigV2``): format and family of the model, and the
    layers' digests as the rootfs."""
    info = info or {}
    family = info.get("architecture") or ""
    config = {
        "model_format": "gguf",
        "model_family": family,
        "model_families": [family] if family else [],
        "model_type": info.get("parameter_size") or "",
        "file_type": info.get("quantization") or "",
        "architecture": "amd64",
        "os": "linux",
        "rootfs": {"type": "layers", "diff_ids": [layer.digest for layer in layers]},
    }
    return json.dumps(config, separators=(",", ":")).encode()


def build_manifest(layout: StoreLayout, layers: list[Layer], info: dict | None = None) -> Manifest:
    """A manifest over ``layers`` (already in the store), writing its config blob."""

    config_bytes = make_config(layers, info)
    digest = write_blob(layout, config_bytes)
    return Manifest(Layer(CONFIG, digest, len(config_bytes)), list(layers))


def manifest_mtime(layout: StoreLayout, ref: Ref) -> float:
    return Path(layout.manifest_path(ref)).stat().st_mtime
