"""Making models in the store: from a Modelfile (``pagoda create``), from the catalog (``pagoda
pull smollm2`` records the pulled GGUF as a model), and copies (``pagoda cp``, also out of
Ollama's store)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from pagoda.loader import catalog
from pagoda.store import blobs, manifests, ollama_store
from pagoda.store.adapter_layer import adapter_layer
from pagoda.store.layout import Ref, StoreLayout, default_layout, parse_ref
from pagoda.store.manifests import Layer, Manifest
from pagoda.store.model_info import gguf_info
from pagoda.store.modelfile import Modelfile, ModelfileError


def _text_layer(layout: StoreLayout, media_type: str, text: str) -> Layer:
    data = text.encode()
    return Layer(media_type, blobs.write_blob(layout, data), len(data))


def _json_layer(layout: StoreLayout, media_type: str, value) -> Layer:
    return _text_layer(layout, media_type, json.dumps(value, sort_keys=True, separators=(",", ":")))


def _model_info(layout: StoreLayout, layers: list[Layer]) -> dict:
    model = next((layer for layer in layers if layer.media_type == manifests.MODEL), None)
    if model is None:
        return {}
    try:
        return gguf_info(layout.blob_path(model.digest))
    except ValueError:
        return {}


def locate(text: str) -> tuple[StoreLayout, Ref, Manifest]:
    """A model by name: ``ollama:NAME`` in Ollama's store, else pagoda's store, else the catalog
    (pulled and recorded on the way). ValueError if there is no such model."""
    if ollama_store.is_ollama_name(text):
        layout, ref = ollama_store.ollama_layout(), ollama_store.parse_ollama_name(text)
        manifest = manifests.read_manifest(layout, ref)
        if manifest is None:
            raise ValueError(f"{text!r} not found in Ollama's store at {layout.root}")
        return layout, ref, manifest
    layout = default_layout()
    ref = parse_ref(text)
    manifest = manifests.read_manifest(layout, ref)
    if manifest is None:
        entry = catalog_entry_for(text)
        if entry is not None:
            ref, manifest = record_catalog_model(layout, entry.name)
            return layout, ref, manifest
        raise ValueError(f"model {text!r} not found in the store at {layout.root} (`pagoda list`)")
    return layout, ref, manifest


def catalog_entry_for(text: str):
    """The catalog entry ``text`` names (``smollm2``, ``smollm2:latest``), else None."""
    entry = catalog.resolve_catalog_name(text)
    if entry is not None:
        return entry
    try:
        ref = parse_ref(text)
    except ValueError:
        return None
    if ref.short() == f"{ref.name}:latest":  # default host and namespace, tag latest
        return catalog.resolve_catalog_name(ref.name)
    return None


def record_catalog_model(layout: StoreLayout, name: str, *, quiet: bool = True) -> tuple[Ref, Manifest]:
    """Pull catalog model ``name`` (as ``pagoda pull`` always has) and record it in the store as
    ``NAME:latest``: its GGUF hard-linked as the model blob (no second copy), a config blob, a
    manifest. Returns the reference and manifest."""
    entry = catalog.resolve_catalog_name(name)
    if entry is None:
        raise ValueError(f"unknown catalog model {name!r}")
    path = catalog.pull(entry.name, quiet=quiet)
    digest = "sha256:" + entry.sha256
    blobs.import_file(layout, path, digest, link=True)
    layers = [Layer(manifests.MODEL, digest, path.stat().st_size)]
    ref = parse_ref(entry.name)
    existing = manifests.read_manifest(layout, ref)
    if existing is not None and [x.digest for x in existing.layers] == [digest]:
        return ref, existing
    manifest = manifests.build_manifest(layout, layers, _model_info(layout, layers))
    manifests.write_manifest(layout, ref, manifest)
    return ref, manifest


def copy_model(src: str, dst: str) -> tuple[Ref, Manifest]:
    """``pagoda cp SRC DST``: DST gets SRC's manifest (the same bytes, so the same digest); blobs
    from another store (Ollama's) are hard-linked in, or copied."""
    src_layout, _, manifest = locate(src)
    layout = default_layout()
    dst_ref = parse_ref(dst)
    if src_layout.root != layout.root:
        for layer in manifest.blobs():
            blobs.import_file(layout, src_layout.blob_path(layer.digest), layer.digest, link=True)
    manifests.write_manifest(layout, dst_ref, manifest)
    return dst_ref, manifest


def _starts_like_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


QUANTIZE_TYPES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")  # what FROM a HF directory may become


def _converted_layer(layout: StoreLayout, modelfile: Modelfile, hf_dir: Path, quantize: str | None) -> Layer:
    """A Hugging Face directory written as one GGUF (loader/gguf_writer.py; F16 unless
    `quantize` says otherwise, as Ollama imports safetensors), stored as the model layer."""
    from pagoda.loader.gguf_writer import write_gguf  # deferred: loads numpy

    qtype = (quantize or "f16").lower()
    if qtype not in QUANTIZE_TYPES:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_TYPES)}, got {quantize!r}")
    layout.blobs_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".convert-", dir=layout.blobs_dir) as tmp:
        out = Path(tmp) / "model.gguf"
        try:
            write_gguf(hf_dir, out, qtype.upper(), name=hf_dir.name)
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise ModelfileError(modelfile.from_line, f"FROM {modelfile.from_}: {e}") from None
        digest = blobs.import_file(layout, out)
        return Layer(manifests.MODEL, digest, out.stat().st_size)


def create_model(name: str, modelfile: Modelfile, *, layout: StoreLayout | None = None,
                 progress: bool = False, quantize: str | None = None) -> tuple[Ref, Manifest]:
    """``pagoda create NAME -f Modelfile [--quantize Q]``. FROM a .gguf file (copied into the
    store, hashed on the way), a Hugging Face directory (written as a GGUF in F16 or `quantize`),
    or a model name (its layers are inherited: a new TEMPLATE / SYSTEM / MESSAGE / ADAPTER
    replaces the old, PARAMETERs are merged over the old, LICENSEs add up)."""
    layout = layout or default_layout()
    layout.check_writable()
    ref = parse_ref(name)
    inherited: list[Layer] = []
    params: dict = {}
    path = modelfile.from_path()
    converted = None
    if path is not None and path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if (path / "config.json").is_file():
            converted = _converted_layer(layout, modelfile, path, quantize)
            path = None
        elif len(ggufs) == 1:
            path = ggufs[0]
        else:
            raise ModelfileError(modelfile.from_line, f"FROM {modelfile.from_}: neither a Hugging Face model "
                                 "directory (config.json) nor a directory holding one .gguf file")
    if quantize is not None and converted is None:
        raise ValueError("quantize applies to a model created FROM a Hugging Face directory; a GGUF keeps its "
                         "own quantization")
    if converted is not None:
        inherited.append(converted)
    elif path is not None:
        if path.suffix != ".gguf" and not _starts_like_gguf(path):  # a blob (sha256-...) has no suffix
            raise ModelfileError(modelfile.from_line, f"FROM {modelfile.from_}: not a .gguf file")

        gguf_info(path)  # a readable GGUF, or ValueError before anything is stored
        bar = None
        if progress:
            from tqdm.auto import tqdm  # deferred: tqdm loads on first use

            bar = tqdm(total=path.stat().st_size, unit="B", unit_scale=True, unit_divisor=1024,
                       desc=f"copying {path.name}")
        try:
            digest = blobs.import_file(layout, path, progress=bar.update if bar else None)
        finally:
            if bar:
                bar.close()
        inherited.append(Layer(manifests.MODEL, digest, path.stat().st_size))
    else:
        looks_like_path = modelfile.from_.startswith((".", "/", "~")) or modelfile.from_.endswith(".gguf")
        if looks_like_path:
            raise ModelfileError(modelfile.from_line, f"FROM {modelfile.from_}: no such file or directory")
        try:
            src_layout, _, base = locate(modelfile.from_)
        except ValueError as e:
            raise ModelfileError(modelfile.from_line, f"FROM {modelfile.from_}: {e}") from None
        for layer in base.layers:
            if src_layout.root != layout.root:
                blobs.import_file(layout, src_layout.blob_path(layer.digest), layer.digest, link=True)
            if layer.media_type == manifests.PARAMS:
                params = json.loads(layout.blob_path(layer.digest).read_bytes() or b"{}")
                continue
            replaced = {manifests.TEMPLATE: modelfile.template, manifests.SYSTEM: modelfile.system,
                        manifests.MESSAGES: modelfile.messages or None, manifests.ADAPTER: modelfile.adapter}
            if replaced.get(layer.media_type) is not None:
                continue
            inherited.append(layer)
    layers = list(inherited)
    if modelfile.adapter is not None:
        layers.append(adapter_layer(layout, modelfile, next(x for x in layers if x.media_type == manifests.MODEL)))
    if modelfile.template is not None:
        layers.append(_text_layer(layout, manifests.TEMPLATE, modelfile.template))
    if modelfile.system is not None:
        layers.append(_text_layer(layout, manifests.SYSTEM, modelfile.system))
    for text in modelfile.licenses:
        layers.append(_text_layer(layout, manifests.LICENSE, text))
    if modelfile.messages:
        layers.append(_json_layer(layout, manifests.MESSAGES, modelfile.messages))
    params.update(modelfile.parameters)
    if params:
        layers.append(_json_layer(layout, manifests.PARAMS, params))
    manifest = manifests.build_manifest(layout, layers, _model_info(layout, layers))
    manifests.write_manifest(layout, ref, manifest)
    return ref, manifest


def read_text_layer(layout: StoreLayout, manifest: Manifest, media_type: str) -> str | None:
    layer = manifest.layer(media_type)
    return None if layer is None else layout.blob_path(layer.digest).read_text()


def read_params(layout: StoreLayout, manifest: Manifest) -> dict:
    text = read_text_layer(layout, manifest, manifests.PARAMS)
    if not text:
        return {}
    try:
        params = json.loads(text)
    except ValueError:
        raise ValueError(f"the params layer of this model is not JSON: {text[:80]!r}") from None
    return params if isinstance(params, dict) else {}


def model_path_of(layout: StoreLayout, manifest: Manifest) -> Path:
    layer = manifest.layer(manifests.MODEL)
    if layer is None:
        raise ValueError("this model has no model layer (application/vnd.ollama.image.model)")
    path = layout.blob_path(layer.digest)
    if not path.is_file():
        raise ValueError(f"the model blob {layer.digest} is missing from {layout.blobs_dir}")
    return path
