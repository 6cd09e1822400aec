"""Keys of KV blocks that hold across processes and restarts.

A block's key is a chain hash: ``h(parent key, its tokens)``, with the chain's root the hash of the
model's identity (weights, dtype, KV dtype, block layout) and the request's cache salt (its tenant).
A block's KV depends on every token before it, so equal keys mean equal KV; another model,
quantization, KV dtype or tenant gives another root and so never a hit.
"""

from __future__ import annotations

import hashlib
from array import array
from pathlib import Path
from typing import Any

KEY_BYTES = 16  # blake2b digest size: 128 bits, no accidental collision among any number of blocks on disk


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for p in parts:
        h.update(p)
    return h.digest()


def chain_root(identity: bytes, salt: Any) -> bytes:
    """The root of a chain: the model's identity and the request's cache salt (None: no tenant)."""
    return _digest(b"pagoda-kv-root\0", identity, b"\0salt\0", repr(salt).encode())


def extend_chain(keys: list[bytes], root: bytes, tokens: list[int], block_size: int, upto: int) -> None:
    """Append to ``keys`` (the chain's first blocks) the keys of blocks ``len(keys)`` .. ``upto`` - 1."""
    parent = keys[-1] if keys else root
    for i in range(len(keys), upto):
        parent = _digest(parent, array("q", tokens[i * block_size:(i + 1) * block_size]).tobytes())
        keys.append(parent)


def _weights_fingerprint(files: Any) -> list[str]:
    """Name, size and modification time of each weight file: a model rewritten in place is another model."""
    paths: list[Path] = []
    if files.encryption is not None:
        return [f"sealed:{files.encryption.header_sha256}"]
    if files.gguf_file is not None:
        paths.append(Path(files.gguf_file))
    else:
        paths += sorted(Path(files.metadata_dir).glob("*.safetensors"))
    out = []
    for p in paths:
        st = p.stat()
        out.append(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}")
    return out


def model_identity(config: Any, num_kv_heads: int, head_dim: int, num_slots: int) -> bytes:
    """What a block's KV depends on besides its tokens, as bytes: the model (its weight files,
    architecture, dtype, quantization), the KV cache's dtype and the block's shape."""
    mc, cc = config.model, config.cache
    parts = [
        "pagoda-kv-v1", mc.architecture, str(mc.dtype), str(mc.quantization), str(cc.kv_cache_dtype or mc.dtype),
        f"bs={cc.block_size}", f"heads={num_kv_heads}", f"dim={head_dim}", f"slots={num_slots}",
        *_weights_fingerprint(mc.files),
    ]
    return "\n".join(parts).encode()
