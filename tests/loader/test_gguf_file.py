"""The GGUF reader (pagoda/loader/gguf_file.py): the metadata and tensor table gguf.GGUFReader
reads; a truncated file or one that is no GGUF fails with a clear error, wherever it is read."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

from pagoda.loader.gguf_file import read_gguf
from pagoda.loader.gguf_model_dir import convert_gguf_metadata
from pagoda.loader.gguf_weights import iter_gguf_weights


def test_reader_matches_gguf_reader(gguf_f32):
    """Our fast parser reads the same metadata and tensor table as gguf.GGUFReader."""
    ours = read_gguf(gguf_f32["qwen3"])
    reference = gguf.GGUFReader(gguf_f32["qwen3"])
    for key, field in reference.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        assert ours.metadata[key] == (pytest.approx(value, rel=1e-6) if isinstance(value, float) else value), key
    assert [t.name for t in reference.tensors] == list(ours.tensors)
    for t in reference.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(reversed(t.shape.tolist())) and info.ggml_type == t.tensor_type
        assert np.array_equal(ours.stored_array(info).reshape(-1), np.asarray(t.data).reshape(-1))


def test_truncated_file_is_a_clear_error(gguf_f32, tmp_path):
    data = gguf_f32["llama"].read_bytes()
    for name, cut in [("half", len(data) // 2), ("header", 100)]:
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="is truncated"):
            read_gguf(path)
        with pytest.raises(ValueError, match="is truncated"):
            list(iter_gguf_weights(path, {"model_type": "llama"}))
        with pytest.raises(ValueError, match="is truncated"):
            convert_gguf_metadata(path, tmp_path / f"out-{name}")


def test_not_a_gguf_file(tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match="not a valid GGUF file"):
        read_gguf(garbage)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="not a valid GGUF file"):
        read_gguf(empty)
