"""Model references (``[host/][namespace/]name[:tag]``) and where a store keeps things.

A store is a directory in Ollama's inner layout (what ``~/.ollama/models`` holds)::

    ROOT/blobs/sha256-<hex>                       content-addressed files
    ROOT/manifests/<host>/<namespace>/<name>/<tag>  one manifest (JSON) per reference

pagoda's own store is ``$PAGODA_HOME/store`` (``store_root()``): beside, not inside, the catalog's
``$PAGODA_HOME/models/<name>/``, so neither can mistake the other's files for its own; point
``OLLAMA_MODELS`` at it and Ollama reads it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pagoda.home import pagoda_home

DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"

_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(:[0-9]{1,5})?$")
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,79}$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,79}$")
_DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")


@dataclass(frozen=True)
class Ref:
    """A model reference with every part filled in (Ollama's defaults for those not given)."""

    host: str
    namespace: str
    name: str
    tag: str
    scheme: str | None = None  # "http" / "https" when the text said so (http implies --insecure)

    @property
    def repository(self) -> str:
        """The registry's repository name: ``namespace/name``."""
        return f"{self.namespace}/{self.name}"

    def __str__(self) -> str:
        return f"{self.host}/{self.namespace}/{self.name}:{self.tag}"

    def short(self) -> str:
        """How Ollama shows it: the default host and namespace left out."""
        if self.host != DEFAULT_HOST:
            return str(self)
        if self.namespace != DEFAULT_NAMESPACE:
            return f"{self.namespace}/{self.name}:{self.tag}"
        return f"{self.name}:{self.tag}"


def parse_ref(text: str) -> Ref:
    """``[scheme://][host/][namespace/]name[:tag]`` → ``Ref`` (Ollama's defaults:
    registry.ollama.ai, library, latest).

    With two parts, the first is a host when it looks like one (has a '.' or a ':port', or is
    ``localhost``), as Docker reads it; otherwise a namespace. Raises ValueError naming the bad part.
    """
    original = text
    text = text.strip()
    scheme = None
    if "://" in text:
        scheme, _, text = text.partition("://")
        if scheme not in ("http", "https"):
            raise ValueError(f"{original!r}: unknown scheme {scheme!r} (http or https)")
    if not text:
        raise ValueError("empty model reference")
    if "@" in text:
        raise ValueError(f"{original!r}: references by digest (name@sha256:...) are not supported; use a tag")
    head, slash, last = text.rpartition("/")
    name, colon, tag = last.partition(":")
    if colon and not tag:
        raise ValueError(f"{original!r}: empty tag after ':'")
    tag = tag or DEFAULT_TAG
    parts = head.split("/") if slash else []
    if len(parts) > 2:
        raise ValueError(f"{original!r}: too many '/' (expected [host/][namespace/]name[:tag])")
    host, namespace = DEFAULT_HOST, DEFAULT_NAMESPACE
    if len(parts) == 2:
        host, namespace = parts
    elif len(parts) == 1:
        first = parts[0]
        if "." in first or ":" in first or first == "localhost":
            host = first
        else:
            namespace = first
    if not _HOST.match(host):
        raise ValueError(f"{original!r}: invalid host {host!r}")
    for what, value in (("namespace", namespace), ("name", name)):
        if not _PART.match(value):
            raise ValueError(f"{original!r}: invalid {what} {value!r} (letters, digits, '.', '_', '-'; "
                             f"starting with a letter or digit; at most 80)")
    if not _TAG.match(tag):
        raise ValueError(f"{original!r}: invalid tag {tag!r}")
    return Ref(host, namespace, name, tag, scheme)


def store_root() -> Path:
    """pagoda's store: ``$PAGODA_HOME/store``."""
    return pagoda_home() / "store"


def digest_hex(digest: str) -> str:
    """``sha256:<hex>`` (or ``sha256-<hex>``) → ``<hex>``; ValueError for anything else."""
    match = _DIGEST.match(digest)
    if not match:
        raise ValueError(f"not a sha256 digest: {digest!r}")
    return match.group(1)


class StoreLayout:
    """The paths of one store directory (pagoda's, or Ollama's read in place)."""

    def __init__(self, root: Path, *, read_only: bool = False) -> None:
        self.root = Path(root)
        self.read_only = read_only

    def __repr__(self) -> str:
        return f"StoreLayout({str(self.root)!r}{', read_only=True' if self.read_only else ''})"

    @property
    def blobs_dir(self) -> Path:
        return self.root / "blobs"

    @property
    def manifests_dir(self) -> Path:
        return self.root / "manifests"

    def blob_path(self, digest: str) -> Path:
        """Where the blob ``digest`` lives: ``blobs/sha256-<hex>`` (Ollama before 0.1.30 wrote
        ``sha256:<hex>``; such a file is used when it is the one present)."""
        hexdigest = digest_hex(digest)
        path = self.blobs_dir / f"sha256-{hexdigest}"
        if not path.exists():
            legacy = self.blobs_dir / f"sha256:{hexdigest}"
            if legacy.exists():
                return legacy
        return path

    def manifest_path(self, ref: Ref) -> Path:
        return self.manifests_dir / ref.host / ref.namespace / ref.name / ref.tag

    def refs(self) -> list[Ref]:
        """Every reference with a manifest, sorted."""
        found = []
        if not self.manifests_dir.is_dir():
            return found
        for path in self.manifests_dir.glob("*/*/*/*"):
            if not path.is_file() or path.name.startswith("."):
                continue
            host, namespace, name, tag = path.relative_to(self.manifests_dir).parts
            found.append(Ref(host, namespace, name, tag))
        return sorted(found, key=str)

    def check_writable(self) -> None:
        if self.read_only:
            raise ValueError(f"{self.root} is read-only to pagoda (Ollama's store is read in place)")


def default_layout() -> StoreLayout:
    return StoreLayout(store_root())
