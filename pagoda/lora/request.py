"""``LoRARequest``: which adapter a request runs under, as vLLM spells it."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, id and files.

    ``lora_int_id`` (>= 1) tells the workers which adapter a row runs under: a new version of an
    adapter loaded under the same name gets a new id, so requests already running keep theirs.
    ``fingerprint``: a hash of the adapter's files, filled in by the engine before the request is
    queued; the prefix cache keys on it, so two versions never share KV and the same files do."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None
    fingerprint: str = ""

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1 (0 is the base model), got {self.lora_int_id}")

    @property
    def prefix_key(self) -> tuple[str, str]:
        """What the prefix cache adds to a request's salt under this adapter."""
        return ("lora", self.fingerprint or f"{self.lora_name}#{self.lora_int_id}")

    def with_fingerprint(self) -> LoRARequest:
        return self if self.fingerprint else replace(self, fingerprint=files_fingerprint(self.lora_path))


def files_fingerprint(path: str) -> str:
    """sha256 over an adapter directory's (or file's) names and bytes."""
    root = Path(path)
    digest = hashlib.sha256()
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    for file in files:
        digest.update(file.name.encode() + b"\0")
        with open(file, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:32]
