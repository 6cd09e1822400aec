"""The tiny Hugging Face models (tests/tiny_models.py) as GGUF files, through pagoda's own writer
(pagoda/loader/gguf_writer.py, what `pagoda create` uses for `FROM` a Hugging Face directory).

This lets the GGUF loader be tested against weights we know, without downloading a model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pagoda.loader.gguf_writer import write_gguf
from pagoda.loader.gguf_writer_tensors import WRITABLE_QTYPES, quantize_weight

EXPORT_QTYPES = WRITABLE_QTYPES
__all__ = ["EXPORT_QTYPES", "export_gguf", "quantize_weight"]


def export_gguf(hf_dir: Path, out_path: Path, qtype: str = "F32", *, architecture: str | None = None,
                customize: Callable | None = None) -> Path:
    """Write the tiny model in ``hf_dir`` to ``out_path`` with 2-D weights in ``qtype`` (F32 by default)."""
    hf_dir = Path(hf_dir)
    return write_gguf(hf_dir, out_path, qtype, name=f"tiny-{hf_dir.name}", architecture=architecture,
                      customize=customize)
