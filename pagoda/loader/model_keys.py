"""Model keys: a key file or $PAGODA_MODEL_KEY holding a 256-bit key or a passphrase, and each
container's own key derived from it (see pagoda/loader/encrypted_container.py for the format)."""

from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

KEY_ENV = "PAGODA_MODEL_KEY"
KEY_SIZE = 32
MIN_PASSPHRASE_BYTES = 8
SCRYPT_PARAMS = {"n": 1 << 15, "r": 8, "p": 1}
HKDF_INFO = b"pagoda-model-encryption/v1"


def tampered_error(path: Path | str, detail: str) -> ValueError:
    return ValueError(f"{path}: wrong key or corrupted/tampered model file: {detail}")


def corrupted_error(path: Path | str, detail: str) -> ValueError:
    return ValueError(f"{path}: corrupted/tampered model file: {detail}")


@dataclass(frozen=True)
class ModelKey:
    """Key material as read from a key file or the environment: a 32-byte key ("raw") or a
    passphrase that scrypt stretches per container. ``source`` says where it came from (messages)."""

    secret: bytes = field(repr=False)
    kind: str  # "raw" or "passphrase"
    source: str


def parse_key(data: bytes, source: str) -> ModelKey:
    """64 hex characters (whitespace around them ignored) or exactly 32 non-text bytes: the key;
    otherwise a passphrase (stripped; at least 8 bytes)."""
    text = data.strip()
    if re.fullmatch(rb"[0-9a-fA-F]{64}", text):
        return ModelKey(bytes.fromhex(text.decode()), "raw", source)
    if len(data) == KEY_SIZE and not all(32 <= b < 127 or b in b"\t\r\n" for b in data):
        return ModelKey(bytes(data), "raw", source)
    if not text:
        raise ValueError(f"the model key from {source} is empty")
    if len(text) < MIN_PASSPHRASE_BYTES:
        raise ValueError(f"the model key from {source} is too short: use 64 hex characters "
                         f"(`pagoda encrypt --generate-key FILE`) or a passphrase of at least "
                         f"{MIN_PASSPHRASE_BYTES} characters")
    return ModelKey(text, "passphrase", source)


def load_key(key_file: str | os.PathLike | None = None, key_env: str = KEY_ENV) -> ModelKey:
    """The key from ``key_file``, else from the environment variable ``key_env``. ValueError if
    neither gives one. Warns when the key file is readable by others."""
    if key_file is not None:
        path = Path(os.path.expanduser(str(key_file)))
        try:
            data = path.read_bytes()
            mode = path.stat().st_mode
        except FileNotFoundError:
            if re.search(r"[0-9a-fA-F]{32}", str(key_file)):  # a key typed in place of its file: do not echo it
                raise ValueError("model key file not found, and its name looks like a key: the option takes "
                                 "the path of a file holding the key, never the key") from None
            raise ValueError(f"model key file not found: {path}") from None
        except OSError as e:
            raise ValueError(f"cannot read the model key file {path}: {e}") from None
        if mode & 0o077:
            logger.warning("model key file %s is accessible by other users (mode %o); chmod 600 it",
                           path, stat.S_IMODE(mode))
        return parse_key(data, f"key file {path}")
    value = os.environ.get(key_env)
    if not value:
        raise ValueError(f"no key for the encrypted model: pass --model-key-file FILE "
                         f"(LLM(model_key_file=...)) or put the key in ${key_env}")
    return parse_key(value.encode(), f"${key_env}")


def derive_file_key(key: ModelKey, kdf: dict[str, Any], salt: bytes, path: Path | str) -> bytes:
    from cryptography.hazmat.primitives import hashes  # cryptography loads on first use
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF  # cryptography loads on first use
    from cryptography.hazmat.primitives.kdf.scrypt import Scrypt  # cryptography loads on first use

    name = kdf.get("name")
    if name == "none":
        if key.kind != "raw":
            raise tampered_error(path, f"it was sealed with a 256-bit key, but the key from {key.source} is a passphrase")
        master = key.secret
    elif name == "scrypt":
        if key.kind != "passphrase":
            raise tampered_error(path, f"it was sealed with a passphrase, but the key from {key.source} is a 256-bit key")
        n, r, p = kdf.get("n"), kdf.get("r"), kdf.get("p")
        if not (isinstance(n, int) and isinstance(r, int) and isinstance(p, int)
                and 2 <= n <= 1 << 20 and n & (n - 1) == 0 and 1 <= r <= 32 and 1 <= p <= 16):
            raise corrupted_error(path, f"invalid scrypt parameters {kdf!r}")
        master = Scrypt(salt=salt, length=KEY_SIZE, n=n, r=r, p=p).derive(key.secret)
    else:
        raise corrupted_error(path, f"unknown key derivation {name!r}")
    return HKDF(algorithm=hashes.SHA256(), length=KEY_SIZE, salt=salt, info=HKDF_INFO).derive(master)
