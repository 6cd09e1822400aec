"""Reading a GGUF file (llama.cpp's format): the metadata as Python values, the tensor table, and
the tensor data as views of a read-only mapping.

We parse the file ourselves instead of using ``gguf.GGUFReader``: the reader builds a numpy view
per array element, which takes ~5 s on SmolLM2's 49k-token vocabulary and ~21 s on Gemma 3's
262k, on every load. Our parser reads the same fields in well under a second, checks every offset
against the file size (a truncated file is a clear ``ValueError``, not a numpy traceback), and
leaves dequantization to ``gguf.quants.dequantize``.

Metadata is capped, since every value becomes a Python object: the arrays of a file hold at most
``MAX_METADATA_ITEMS`` items together (4Mi: five times Gemma 3's vocabulary, scores and token
types) and a string is at most ``MAX_STRING_BYTES`` (64 MiB: twice the largest tokenizer.json
known); a file past either is refused before the values are built. A tensor's dimensions are
each at least 1.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

_GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
MAX_METADATA_ITEMS = 1 << 22
MAX_STRING_BYTES = 64 << 20

# Types stored as plain numbers rather than quantized blocks.
_PLAIN_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                 GGMLQuantizationType.F64: np.float64}


class _Truncated(Exception):
    """A read ran past the end of the file."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file. ``shape`` is in torch order (GGUF stores it reversed)."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # absolute, from the start of the file
    nbytes: int


@dataclass
class GGUFFile:
    """A parsed GGUF: metadata values as Python objects, tensor locations, and the mapped bytes."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    buffer: mmap.mmap

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_key(self, key: str, default: Any = None) -> Any:
        """``{architecture}.{key}`` from the metadata."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def stored_array(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes as ``gguf.quants.dequantize`` takes them: typed for F32/F16/F64, rows of
        uint8 blocks otherwise. Zero-copy (a view of the mapping)."""
        dtype = _PLAIN_DTYPES.get(info.ggml_type)
        if dtype is not None:
            count = math.prod(info.shape)
            return np.frombuffer(self.buffer, dtype=dtype, count=count, offset=info.offset).reshape(info.shape)
        raw = np.frombuffer(self.buffer, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return raw.reshape(*info.shape[:-1], -1)

    def dequantized(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor as float32 in its torch shape. Raises ValueError for a type we cannot decode."""
        _check_dequantizable(info)
        data = self.stored_array(info)
        if info.ggml_type == GGMLQuantizationType.F64:
            return data.astype(np.float32)
        return np.asarray(dequantize(data, info.ggml_type), dtype=np.float32).reshape(info.shape)


class _Cursor:
    """Sequential little-endian reads from the mapped file, each checked against its end."""

    def __init__(self, buf: mmap.mmap):
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.items_left = MAX_METADATA_ITEMS  # what the metadata's arrays may still hold

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise _Truncated(f"needed {n} bytes at offset {self.pos}, but the file has {self.size} bytes")

    def scalar(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n)
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self, what: str = "a name") -> str:
        n = self.scalar("Q")
        if n > MAX_STRING_BYTES:
            raise ValueError(f"{what} is a string of {n} bytes (at most {MAX_STRING_BYTES})")
        self.need(n)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def take_items(self, count: int, key: str) -> None:
        """Count an array's items against the file's ``MAX_METADATA_ITEMS``."""
        if count > self.items_left:
            raise ValueError(f"metadata array {key!r} has {count} items; a file's arrays hold at most "
                             f"{MAX_METADATA_ITEMS} together")
        self.items_left -= count

    def numbers(self, dtype: np.dtype, count: int) -> np.ndarray:
        n = dtype.itemsize * count
        self.need(n)
        values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
        self.pos += n
        return values


# GGUF metadata value types (gguf.GGUFValueType): id → struct format / numpy dtype.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_ARRAY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8",
                 11: "<i8", 12: "<f8"}
_FLOAT32, _STRING, _ARRAY = 6, 8, 9


def _short_float(value: float) -> float:
    """A float32 as the shortest decimal that round-trips, so 1e-6 reads back as 1e-06, not 9.99e-07."""
    return float(str(np.float32(value)))


def _read_value(cur: _Cursor, value_type: int, key: str) -> Any:
    if value_type == _STRING:
        return cur.string(f"metadata {key!r}")
    if value_type == _ARRAY:
        item_type = cur.scalar("I")
        count = cur.scalar("Q")
        cur.take_items(count, key)
        if item_type == _STRING or item_type == _ARRAY:
            cur.need(count * 8)  # every item takes at least 8 bytes: fail fast on a corrupt count
            return [_read_value(cur, item_type, key) for _ in range(count)]
        if item_type not in _ARRAY_DTYPES:
            raise ValueError(f"unknown metadata array item type {item_type}")
        return cur.numbers(np.dtype(_ARRAY_DTYPES[item_type]), count).tolist()
    if value_type not in _SCALAR_FORMATS:
        raise ValueError(f"unknown metadata value type {value_type}")
    value = cur.scalar(_SCALAR_FORMATS[value_type])
    return _short_float(value) if value_type == _FLOAT32 else value


def _read_header(cur: _Cursor) -> tuple[int, int]:
    magic = bytes(cur.buf[0:4])
    if magic != _GGUF_MAGIC:
        raise ValueError(f"bad magic {magic!r} (expected {_GGUF_MAGIC!r})")
    cur.pos = 4
    version = cur.scalar("I")
    if version not in (2, 3):
        hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise ValueError(f"unsupported GGUF version {version}{hint}; supported: 2, 3")
    tensor_count = cur.scalar("Q")
    kv_count = cur.scalar("Q")
    if tensor_count > cur.size or kv_count > cur.size:
        raise ValueError(f"implausible counts: {tensor_count} tensors, {kv_count} metadata keys")
    return tensor_count, kv_count


def _read_tensor_info(cur: _Cursor) -> tuple[str, GGMLQuantizationType, tuple[int, ...], int]:
    name = cur.string()
    n_dims = cur.scalar("I")
    if n_dims > 8:
        raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
    ggml_dims = [cur.scalar("Q") for _ in range(n_dims)]
    if 0 in ggml_dims:  # holds nothing, yet a layer would be built of that size
        raise ValueError(f"tensor {name!r} has a zero-length dimension: shape {list(reversed(ggml_dims))}")
    type_id = cur.scalar("I")
    try:
        ggml_type = GGMLQuantizationType(type_id)
    except ValueError:
        raise ValueError(f"tensor {name!r} has unknown ggml type id {type_id}") from None
    offset = cur.scalar("Q")
    # GGUF lists dimensions fastest-varying first; torch wants them the other way round.
    return name, ggml_type, tuple(reversed(ggml_dims)), offset


def _tensor_nbytes(name: str, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    row = shape[-1] if shape else 1
    if row % block_size:
        raise ValueError(f"tensor {name!r}: row length {row} is not a multiple of the {ggml_type.name} block "
                         f"size {block_size}")
    return math.prod(shape) // block_size * type_size


def _parse(buf: mmap.mmap) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
    cur = _Cursor(buf)
    tensor_count, kv_count = _read_header(cur)
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cur.string()
        metadata[key] = _read_value(cur, cur.scalar("I"), key)
    raw_infos = [_read_tensor_info(cur) for _ in range(tensor_count)]

    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"invalid general.alignment {alignment!r}")
    data_start = -(-cur.pos // alignment) * alignment

    tensors: dict[str, GGUFTensorInfo] = {}
    for name, ggml_type, shape, offset in raw_infos:
        if name in tensors:
            raise ValueError(f"duplicate tensor {name!r}")
        nbytes = _tensor_nbytes(name, ggml_type, shape)
        start = data_start + offset
        if start + nbytes > cur.size:
            raise _Truncated(f"tensor {name!r} needs bytes up to {start + nbytes}, but the file has {cur.size}")
        tensors[name] = GGUFTensorInfo(name, ggml_type, shape, start, nbytes)
    return metadata, tensors


def read_gguf(path: Path | str) -> GGUFFile:
    """Parse a GGUF file's metadata and tensor table (tensor data stays memory-mapped).

    Raises ValueError saying the file is truncated or not a valid GGUF file.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise ValueError(f"{path} is not a valid GGUF file: it is empty")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise ValueError(f"{path} could not be opened as a GGUF file: {exc}") from exc
    try:
        metadata, tensors = _parse(buf)
    except _Truncated as exc:
        raise ValueError(f"{path} is truncated (not a complete GGUF file): {exc}") from None
    except (ValueError, struct.error, OverflowError, MemoryError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not a valid GGUF file: {exc}") from None
    return GGUFFile(path, metadata, tensors, buf)


@lru_cache(maxsize=None)
def _can_dequantize(ggml_type: GGMLQuantizationType) -> bool:
    if ggml_type in _PLAIN_DTYPES:
        return True
    _, type_size = GGML_QUANT_SIZES[ggml_type]
    try:
        dequantize(np.zeros((1, type_size), dtype=np.uint8), ggml_type)
    except NotImplementedError:
        return False
    return True


def _check_dequantizable(info: GGUFTensorInfo) -> None:
    if not _can_dequantize(info.ggml_type):
        supported = sorted(t.name for t in GGMLQuantizationType if _can_dequantize(t))
        raise ValueError(f"tensor {info.name!r} has ggml type {info.ggml_type.name}, which pagoda cannot "
                         f"dequantize (supported: {', '.join(supported)})")
