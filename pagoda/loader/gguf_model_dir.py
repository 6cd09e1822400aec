"""A GGUF as a Hugging-Face-style model directory: ``config.json``, ``tokenizer.json``,
``tokenizer_config.json`` and ``generation_config.json`` (no weights; those come from the GGUF
itself, gguf_weights.py).

``convert_gguf_metadata`` writes them (gguf_config.py, gguf_tokenizer.py). The tokenizer goes
through transformers' GGUF support, which is slow to import (~15 s), so ``load_gguf_model_dir``
caches the result under ``$PAGODA_HOME/converted/<key>/`` and later loads never import
transformers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pagoda.home import pagoda_home
from pagoda.loader.gguf_config import gguf_to_hf_config
from pagoda.loader.gguf_file import read_gguf
from pagoda.loader.gguf_tokenizer import convert_tokenizer, end_of_generation_ids

# Bumped whenever the converted directory's contents change, so stale caches are not reused.
_CONVERTER_VERSION = 1


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf_metadata(gguf_path: Path, out_dir: Path) -> Path:
    """Write a Hugging-Face-style metadata directory (config, tokenizer, generation config; no weights)
    for ``gguf_path`` into ``out_dir`` and return ``out_dir``.

    Imports transformers for the tokenizer (slow); use ``load_gguf_model_dir`` for a cached copy.
    Raises ValueError for an invalid/truncated file or an unsupported architecture.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    gf = read_gguf(gguf_path)
    config = gguf_to_hf_config(gf)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "config.json", config)
    tokenizer, tokenizer_config = convert_tokenizer(gf, config)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    eos_ids = end_of_generation_ids(gf)
    generation_config = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        "pad_token_id": config["pad_token_id"],
    }
    _write_json(out_dir / "generation_config.json", generation_config)
    return out_dir


def _cache_key(gguf_path: Path) -> str:
    resolved = gguf_path.resolve()
    stat = resolved.stat()
    ident = f"{resolved}|{stat.st_size}|{stat.st_mtime_ns}|v{_CONVERTER_VERSION}"
    return hashlib.sha1(ident.encode()).hexdigest()


def load_gguf_model_dir(gguf_path: Path) -> Path:
    """The converted metadata directory for ``gguf_path``, from ``$PAGODA_HOME/converted/<key>/``.

    Converts on first use (into a temporary directory, then renamed into place, so an interrupted
    conversion never leaves a half-written cache entry). Later calls only stat the file.
    """
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    root = pagoda_home() / "converted"
    final = root / _cache_key(gguf_path)
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        convert_gguf_metadata(gguf_path, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a concurrent conversion that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final

