"""Weights from a Hugging Face directory: model.safetensors or shards named by an index file."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: {e}") from None
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise ValueError(f"safetensors shards listed in {index.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_dir}")
    return files


# (name, full shape) → (dim, start, length) of the part to read, or None for all of it
WeightSlicer = Callable[[str, tuple[int, ...]], "tuple[int, int, int] | None"]


def iter_safetensors_weights(model_dir: Path | None, narrow: WeightSlicer | None = None,
                             files: list[Path] | None = None,
                             only: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor by name; with ``narrow`` (tensor parallelism) only the slice this rank holds
    is read from the file (safetensors slices at read time). ``files``: read these instead of the
    directory's (an encrypted model's shards decrypted into memory, pagoda/loader/encrypted_model.py).
    ``only`` (progressive loading): the names to read, the others skipped unread."""
    from safetensors import SafetensorError, safe_open  # deferred: safetensors loads on first use

    for path in files if files is not None else safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if only is not None and not only(name):
                        continue
                    yield name, _read(f, name, narrow, path)
        except SafetensorError as e:
            raise ValueError(f"cannot read weights from {path} (truncated or corrupt safetensors file?): {e}") from None


def _read(f, name: str, narrow: WeightSlicer | None, path: Path) -> torch.Tensor:
    part = f.get_slice(name)  # the header's entry: no data read yet
    shape = tuple(part.get_shape())
    if 0 in shape:  # holds nothing, yet the layer it feeds was built from config.json's sizes
        raise ValueError(f"{path}: tensor {name!r} has a zero-length dimension: shape {list(shape)}")
    cut = narrow(name, shape) if narrow is not None else None
    if cut is None:
        return f.get_tensor(name)
    dim, start, length = cut
    index = [slice(None)] * len(shape)
    index[dim % len(shape)] = slice(start, start + length)
    return part[tuple(index)]
