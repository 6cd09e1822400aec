"""Encrypted models at rest: an authenticated AES-256-GCM container of a whole model.

``pagoda encrypt MODEL -o OUT --key-file K`` seals a GGUF file or a Hugging Face directory (config,
tokenizer, ``*.safetensors``: every file) into one container; ``--model OUT --model-key-file K``
(or the key in ``$PAGODA_MODEL_KEY``) serves it. Decryption happens in memory: the weights are
decrypted into anonymous memory (a Linux ``memfd_create`` file, mapped like the file it replaces)
and never written to disk.

Container format, version 1 (integers big-endian)::

    magic        8 bytes   b"PAGODAEM"
    version      u16       1
    header_len   u32
    header       header_len bytes of UTF-8 JSON: format ("gguf" | "safetensors"), chunk_size,
                 cipher ("AES-256-GCM"), kdf ({"name": "none"} or {"name": "scrypt", n, r, p}),
                 salt (32 random bytes, hex), nonce_prefix (4 random bytes, hex), members
                 ([{name, size}], in storage order), gguf_converter_version (gguf only)
    header_tag   16 bytes  the AES-GCM tag of an empty plaintext whose associated data is every
                           byte before it (nonce: nonce_prefix || FFFFFFFF || FFFFFFFF), so a wrong
                           key or an edited header is caught before anything is decrypted
    chunks       per member, in order: max(1, ceil(size / chunk_size)) chunks, each the AES-256-GCM
                 ciphertext of chunk_size plaintext bytes (the last one shorter) and its 16-byte tag;
                 nonce = nonce_prefix || member index u32 || chunk index u32;
                 AAD = b"PGDC" || SHA-256(magic .. header) || member index u32 || chunk index u32 ||
                 last-chunk flag u8

Every chunk is bound to its place (member, index, last flag) and to the header (and so to every
member's size), so a chunk cannot be edited, moved, swapped, dropped or cut short, and the file's
exact length follows from the header: a truncated file or trailing bytes are errors too.

Keys: a key file (or ``$PAGODA_MODEL_KEY``) holding 64 hex characters (what ``pagoda encrypt
--generate-key`` writes) or exactly 32 raw bytes is the 256-bit master key. Anything else is a
passphrase (surrounding whitespace stripped, at least 8 bytes), stretched with scrypt (n=2**15, r=8,
p=1) over the container's salt. The key that seals the container is
HKDF-SHA256(master key, salt=the container's salt, info=b"pagoda-model-encryption/v1"): each
container has its own key, so its deterministic nonces never repeat under one key.

Loading (``resolve_encrypted_model``, called by ``pagoda.loader.resolve.resolve_model`` when a file
starts with the magic): the tokenizer code and transformers read metadata from a directory, so the
small non-weight members (config.json, tokenizer files, chat templates; for a GGUF, the HF-style
metadata converted at encryption time) are written into a private directory (mode 0700, in
``/dev/shm`` where it exists, so in memory; else the system temp directory), removed when the
process that made it exits. Weight members (``*.safetensors``, ``*.gguf``, ...) are never written
there: ``open_encrypted_weights`` (called by ``pagoda.loader.model_loader``) decrypts them into
memfds, verifying every chunk before the first tensor is yielded, and hands their
``/proc/self/fd/N`` paths to the ordinary safetensors / GGUF readers.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import stat
import struct
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagoda.loader.resolve import ModelFiles

logger = logging.getLogger(__name__)

MAGIC = b"PAGODAEM"
VERSION = 1
KEY_ENV = "PAGODA_MODEL_KEY"
DEFAULT_CHUNK_SIZE = 1 << 20
MIN_CHUNK_SIZE = 4096
MAX_CHUNK_SIZE = 64 << 20
TAG_SIZE = 16
KEY_SIZE = 32
SALT_SIZE = 32
NONCE_PREFIX_SIZE = 4
MIN_PASSPHRASE_BYTES = 8
SCRYPT_PARAMS = {"n": 1 << 15, "r": 8, "p": 1}
HKDF_INFO = b"pagoda-model-encryption/v1"
CHUNK_AAD_LABEL = b"PGDC"
CIPHER = "AES-256-GCM"

_PREFIX = struct.Struct(">8sHI")  # magic, version, header_len
_MAX_HEADER = 16 << 20
_HEADER_INDEX = 0xFFFFFFFF  # member and chunk index of the header tag's nonce (no member has it)
# Files that are weights: decrypted only into memory, never into the metadata directory.
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".ckpt", ".npz", ".npy", ".h5", ".msgpack",
                   ".onnx", ".pkl")


def _tampered(path: Path | str, detail: str) -> ValueError:
    return ValueError(f"{path}: wrong key or corrupted/tampered model file: {detail}")


def _corrupted(path: Path | str, detail: str) -> ValueError:
    return ValueError(f"{path}: corrupted/tampered model file: {detail}")


# --------------------------------------------------------------------------------------------------
# Keys
# --------------------------------------------------------------------------------------------------

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


def generate_key_file(path: str | os.PathLike, *, force: bool = False) -> Path:
    """Write a fresh random 256-bit key to ``path`` as 64 hex characters and a newline, mode 0600.
    Refuses to overwrite an existing file unless ``force``."""
    path = Path(os.path.expanduser(str(path)))
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise ValueError(f"{path} already exists; not overwriting a key (pass --force to replace it)") from None
    except OSError as e:
        raise ValueError(f"cannot create the key file {path}: {e}") from None
    try:
        os.fchmod(fd, 0o600)  # an existing file (force) keeps its mode otherwise
        os.write(fd, (secrets.token_bytes(KEY_SIZE).hex() + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def _derive_file_key(key: ModelKey, kdf: dict[str, Any], salt: bytes, path: Path | str) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

    name = kdf.get("name")
    if name == "none":
        if key.kind != "raw":
            raise _tampered(path, f"it was sealed with a 256-bit key, but the key from {key.source} is a passphrase")
        master = key.secret
    elif name == "scrypt":
        if key.kind != "passphrase":
            raise _tampered(path, f"it was sealed with a passphrase, but the key from {key.source} is a 256-bit key")
        n, r, p = kdf.get("n"), kdf.get("r"), kdf.get("p")
        if not (isinstance(n, int) and isinstance(r, int) and isinstance(p, int)
                and 2 <= n <= 1 << 20 and n & (n - 1) == 0 and 1 <= r <= 32 and 1 <= p <= 16):
            raise _corrupted(path, f"invalid scrypt parameters {kdf!r}")
        master = Scrypt(salt=salt, length=KEY_SIZE, n=n, r=r, p=p).derive(key.secret)
    else:
        raise _corrupted(path, f"unknown key derivation {name!r}")
    return HKDF(algorithm=hashes.SHA256(), length=KEY_SIZE, salt=salt, info=HKDF_INFO).derive(master)


# --------------------------------------------------------------------------------------------------
# The container
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Member:
    index: int
    name: str
    size: int
    offset: int  # of its first chunk in the container
    chunks: int


def _chunk_count(size: int, chunk_size: int) -> int:
    return max(1, math.ceil(size / chunk_size))


def _nonce(prefix: bytes, member: int, chunk: int) -> bytes:
    return prefix + struct.pack(">II", member, chunk)


def _chunk_aad(header_digest: bytes, member: int, chunk: int, last: bool) -> bytes:
    return CHUNK_AAD_LABEL + header_digest + struct.pack(">IIB", member, chunk, int(last))


def _check_member_name(name: Any) -> str:
    """A relative POSIX path without '..' (it names a file under the metadata directory)."""
    if not isinstance(name, str) or not name or "\\" in name or "\x00" in name:
        raise ValueError(f"invalid member name {name!r}")
    parts = PurePosixPath(name).parts
    if name.startswith("/") or any(part in ("..", ".") for part in parts):
        raise ValueError(f"invalid member name {name!r}")
    return name


def is_weight_member(name: str) -> bool:
    return name.lower().endswith(WEIGHT_SUFFIXES)


def is_encrypted_model(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file that starts with the container's magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


class EncryptedModelReader:
    """An open container whose key and header have been checked. ``read_member`` and
    ``decrypt_to_memfd`` authenticate every chunk they return; a failure is a ValueError that says
    "wrong key or corrupted/tampered model file"."""

    def __init__(self, path: str | os.PathLike, key: ModelKey) -> None:
        self.path = Path(path)
        self._fd = -1
        try:
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise ValueError(f"cannot open the encrypted model {self.path}: {e}") from None
        try:
            self._open(key)
        except BaseException:
            self.close()
            raise

    def _open(self, key: ModelKey) -> None:
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        path = self.path
        prefix = os.pread(self._fd, _PREFIX.size, 0)
        if len(prefix) < len(MAGIC) or prefix[:len(MAGIC)] != MAGIC:
            raise ValueError(f"{path} is not a pagoda encrypted model (no {MAGIC!r} magic)")
        if len(prefix) < _PREFIX.size:
            raise _corrupted(path, "truncated inside its header")
        _, version, header_len = _PREFIX.unpack(prefix)
        if version != VERSION:
            raise ValueError(f"{path}: encrypted model format version {version} is not supported "
                             f"(this pagoda reads version {VERSION})")
        if header_len > _MAX_HEADER:
            raise _corrupted(path, f"header length {header_len} is implausible")
        header_bytes = os.pread(self._fd, header_len + TAG_SIZE, _PREFIX.size)
        if len(header_bytes) < header_len + TAG_SIZE:
            raise _corrupted(path, "truncated inside its header")
        signed = prefix + header_bytes[:header_len]
        tag = header_bytes[header_len:]
        try:
            header = json.loads(header_bytes[:header_len].decode("utf-8"))
            self._read_header(header)
        except (ValueError, KeyError, TypeError) as e:
            raise _tampered(path, f"unreadable header ({e})") from None

        self._aes = AESGCM(_derive_file_key(key, self.kdf, self.salt, path))
        try:
            self._aes.decrypt(_nonce(self.nonce_prefix, _HEADER_INDEX, _HEADER_INDEX), tag, signed)
        except InvalidTag:
            raise _tampered(path, f"the header does not authenticate with the key from {key.source}") from None
        self._invalid_tag = InvalidTag
        self.header_digest = hashlib.sha256(signed).digest()

        offset = len(signed) + TAG_SIZE
        members = []
        for i, (name, size) in enumerate(self._member_list):
            chunks = _chunk_count(size, self.chunk_size)
            members.append(Member(i, name, size, offset, chunks))
            offset += size + chunks * TAG_SIZE
        self.members = members
        actual = os.fstat(self._fd).st_size
        if actual < offset:
            raise _corrupted(path, f"truncated: {actual} bytes, the header promises {offset}")
        if actual > offset:
            raise _corrupted(path, f"trailing data: {actual - offset} bytes after the last chunk")

    def _read_header(self, header: dict[str, Any]) -> None:
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
        if header.get("cipher") != CIPHER:
            raise ValueError(f"unsupported cipher {header.get('cipher')!r}")
        self.format = header["format"]
        if self.format not in ("gguf", "safetensors"):
            raise ValueError(f"unknown model format {self.format!r}")
        self.chunk_size = header["chunk_size"]
        if not isinstance(self.chunk_size, int) or not MIN_CHUNK_SIZE <= self.chunk_size <= MAX_CHUNK_SIZE:
            raise ValueError(f"invalid chunk_size {self.chunk_size!r}")
        self.salt = bytes.fromhex(header["salt"])
        self.nonce_prefix = bytes.fromhex(header["nonce_prefix"])
        if len(self.salt) != SALT_SIZE or len(self.nonce_prefix) != NONCE_PREFIX_SIZE:
            raise ValueError("invalid salt or nonce prefix")
        self.kdf = header["kdf"]
        if not isinstance(self.kdf, dict):
            raise ValueError("invalid kdf")
        members = header["members"]
        if not isinstance(members, list) or not members or len(members) >= _HEADER_INDEX:
            raise ValueError("invalid member list")
        self._member_list = []
        for m in members:
            name, size = _check_member_name(m["name"]), m["size"]
            if not isinstance(size, int) or size < 0:
                raise ValueError(f"invalid size {size!r} of {name!r}")
            self._member_list.append((name, size))
        if len({n for n, _ in self._member_list}) != len(self._member_list):
            raise ValueError("duplicate member names")
        self.gguf_converter_version = header.get("gguf_converter_version")
        self.header = header

    # -- reading ----------------------------------------------------------------------------
    def member(self, name: str) -> Member:
        for m in self.members:
            if m.name == name:
                return m
        raise KeyError(name)

    def iter_chunks(self, member: Member) -> Iterator[bytes]:
        """The member's plaintext, chunk by chunk, each authenticated before it is returned."""
        cs = self.chunk_size
        for i in range(member.chunks):
            plain_len = min(cs, member.size - i * cs)
            want = plain_len + TAG_SIZE
            data = os.pread(self._fd, want, member.offset + i * (cs + TAG_SIZE))
            if len(data) != want:
                raise _corrupted(self.path, f"truncated in chunk {i} of {member.name!r}")
            last = i == member.chunks - 1
            try:
                yield self._aes.decrypt(_nonce(self.nonce_prefix, member.index, i), data,
                                        _chunk_aad(self.header_digest, member.index, i, last))
            except self._invalid_tag:
                raise _tampered(self.path, f"chunk {i} of {member.name!r} does not authenticate") from None

    def read_member(self, member: Member) -> bytes:
        return b"".join(self.iter_chunks(member))

    def decrypt_to_memfd(self, member: Member) -> int:
        """A memfd (anonymous memory, close-on-exec) holding the member's plaintext, every chunk
        authenticated. The caller closes it; ``/proc/self/fd/N`` opens it like a file."""
        if not hasattr(os, "memfd_create"):
            raise ValueError("loading an encrypted model needs Linux (os.memfd_create), so that the "
                             "decrypted weights stay in memory")
        fd = os.memfd_create(f"pagoda-decrypted:{PurePosixPath(member.name).name}", os.MFD_CLOEXEC)
        try:
            for plain in self.iter_chunks(member):
                view = memoryview(plain)
                while view:
                    view = view[os.write(fd, view):]
            return fd
        except BaseException:
            os.close(fd)
            raise

    def verify(self) -> int:
        """Authenticate every chunk of every member; returns the plaintext byte count."""
        total = 0
        for m in self.members:
            for plain in self.iter_chunks(m):
                total += len(plain)
        return total

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> EncryptedModelReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Source:
    name: str
    path: Path
    size: int


def _hf_dir_sources(model_dir: Path) -> list[_Source]:
    """Every regular file under the directory (symlinks followed; hidden files and directories
    skipped), metadata first, then weights, each group in name order."""
    sources = []
    for root, dirs, files in os.walk(model_dir, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name.startswith("."):
                continue
            path = Path(root) / name
            if not path.is_file() or is_encrypted_model(path):  # e.g. an earlier container written here
                continue
            rel = path.relative_to(model_dir).as_posix()
            sources.append(_Source(rel, path, path.stat().st_size))
    sources.sort(key=lambda s: (is_weight_member(s.name), s.name))
    return sources


def _gguf_metadata_dir(gguf_path: Path, scratch: Path) -> Path:
    """The HF-style metadata pagoda converts a GGUF to: the cached conversion if there is one,
    else converted into ``scratch`` (no cache entry is left behind)."""
    from pagoda.home import pagoda_home
    from pagoda.loader import gguf

    cached = pagoda_home() / "converted" / gguf._cache_key(gguf_path)
    if (cached / "config.json").is_file() and (cached / "tokenizer.json").is_file():
        return cached
    return gguf.convert_gguf_metadata(gguf_path, scratch)


def _model_sources(model: Path, scratch: Path, name: str) -> tuple[str, list[_Source], dict[str, Any]]:
    if model.is_dir():
        if not (model / "config.json").is_file():
            ggufs = sorted(model.glob("*.gguf"))
            if len(ggufs) == 1:
                return _model_sources(ggufs[0], scratch, name)
            raise ValueError(f"{model} is not a model directory: no config.json (and not exactly one .gguf file)")
        sources = _hf_dir_sources(model)
        if not any(s.name.endswith(".safetensors") for s in sources):
            raise ValueError(f"no *.safetensors weights in {model}")
        return "safetensors", sources, {}
    if model.is_file():
        if is_encrypted_model(model):
            raise ValueError(f"{model} is already an encrypted model")
        if model.suffix != ".gguf":
            raise ValueError(f"{model}: a model file must be a .gguf file (or pass a Hugging Face model directory)")
        return _gguf_sources(model, _gguf_metadata_dir(model, scratch))
    # A catalog or store name (`smollm2`, `name:tag`, `ollama:NAME`): what --model would load, the
    # store's overlays (context, system prompt, template) included.
    from pagoda.loader.resolve import resolve_model

    files = resolve_model(name)
    if files.encryption is not None:
        raise ValueError(f"{name} is already an encrypted model")
    if files.gguf_file is not None:
        return _gguf_sources(Path(files.gguf_file), Path(files.metadata_dir))
    return _model_sources(Path(files.metadata_dir), scratch, name)


def _gguf_sources(gguf_path: Path, meta: Path) -> tuple[str, list[_Source], dict[str, Any]]:
    from pagoda.loader.gguf import _CONVERTER_VERSION

    sources = [_Source(p.name, p, p.stat().st_size) for p in sorted(meta.iterdir())
               if p.is_file() and not is_weight_member(p.name)]
    member = gguf_path.name if gguf_path.name.endswith(".gguf") else "model.gguf"  # store blobs: sha256-<hex>
    sources.append(_Source(member, gguf_path, gguf_path.stat().st_size))
    return "gguf", sources, {"gguf_converter_version": _CONVERTER_VERSION}


def encrypt_model(model: str | os.PathLike, out: str | os.PathLike, key: ModelKey, *,
                  chunk_size: int = DEFAULT_CHUNK_SIZE, force: bool = False,
                  progress: Callable[[int], None] | None = None) -> Path:
    """Seal ``model`` (a .gguf file, a Hugging Face directory, or a catalog / store name as
    ``--model`` takes it) into the container ``out``.

    A GGUF is stored with its HF-style metadata (config, tokenizer) converted now, so that loading
    the container never needs transformers. Written to a temporary file beside ``out``, then renamed:
    an interrupted run leaves no partial container. ``progress(n)`` is called with plaintext bytes
    as they are sealed."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    model_arg = str(model)
    model = Path(os.path.expanduser(model_arg))
    out = Path(os.path.expanduser(str(out)))
    if not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
        raise ValueError(f"chunk size must be in [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}] bytes, got {chunk_size}")
    if out.exists():
        if model.exists() and out.resolve() == model.resolve():
            raise ValueError(f"the output {out} would overwrite the model it encrypts")
        if not force:
            raise ValueError(f"{out} already exists (pass --force to replace it)")
        if out.is_dir():
            raise ValueError(f"{out} is a directory")
    salt, nonce_prefix = secrets.token_bytes(SALT_SIZE), secrets.token_bytes(NONCE_PREFIX_SIZE)
    kdf = {"name": "none"} if key.kind == "raw" else {"name": "scrypt", **SCRYPT_PARAMS}
    aes = AESGCM(_derive_file_key(key, kdf, salt, out))
    scratch = Path(tempfile.mkdtemp(prefix="pagoda-encrypt-"))
    tmp_path: Path | None = None
    try:
        fmt, sources, extra = _model_sources(model, scratch, model_arg)
        header = {
            "format": fmt, "cipher": CIPHER, "chunk_size": chunk_size, "kdf": kdf,
            "salt": salt.hex(), "nonce_prefix": nonce_prefix.hex(),
            "members": [{"name": s.name, "size": s.size} for s in sources], **extra,
        }
        header_json = json.dumps(header, sort_keys=True).encode()
        signed = _PREFIX.pack(MAGIC, VERSION, len(header_json)) + header_json
        digest = hashlib.sha256(signed).digest()
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
        tmp_path = Path(name)
        with os.fdopen(fd, "wb") as f:
            f.write(signed)
            f.write(aes.encrypt(_nonce(nonce_prefix, _HEADER_INDEX, _HEADER_INDEX), b"", signed))
            for index, source in enumerate(sources):
                _seal_member(f, aes, source, index, chunk_size, nonce_prefix, digest, progress)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, out)
        tmp_path = None
        return out
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if tmp_path is not None:
            tmp_path.unlink(missing_ok=True)


def _seal_member(f, aes, source: _Source, index: int, chunk_size: int, nonce_prefix: bytes, digest: bytes,
                 progress: Callable[[int], None] | None) -> None:
    chunks = _chunk_count(source.size, chunk_size)
    with open(source.path, "rb") as src:
        for i in range(chunks):
            plain = src.read(chunk_size)
            expected = min(chunk_size, source.size - i * chunk_size)
            if len(plain) != expected:
                raise ValueError(f"{source.path} changed while it was being encrypted")
            last = i == chunks - 1
            f.write(aes.encrypt(_nonce(nonce_prefix, index, i), plain, _chunk_aad(digest, index, i, last)))
            if progress is not None:
                progress(len(plain))
        if src.read(1):
            raise ValueError(f"{source.path} changed while it was being encrypted")


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EncryptedModel:
    """Where a resolved model's weights come from when it is a container (``ModelFiles.encryption``).
    Holds the key's location, never the key: it is pickled to engine and worker processes, which
    read the key themselves (the same key file, or the same environment variable)."""

    container: Path
    format: str  # "gguf" or "safetensors"
    key_file: Path | None
    key_env: str = KEY_ENV
    header_sha256: str = ""  # of the header seen at resolve time: a container replaced since is an error

    def key(self) -> ModelKey:
        return load_key(self.key_file, self.key_env)


_metadata_dirs: list[tuple[int, Path]] = []


def _remove_metadata_dirs() -> None:
    for pid, path in _metadata_dirs:
        if pid == os.getpid():  # not a forked child's copy of the list
            shutil.rmtree(path, ignore_errors=True)


atexit.register(_remove_metadata_dirs)


def private_metadata_dir() -> Path:
    """A new directory only this user can enter (0700), in ``/dev/shm`` (memory) where possible,
    removed when this process exits."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK) else None
    try:
        path = Path(tempfile.mkdtemp(prefix="pagoda-model-meta-", dir=base))
    except OSError:
        path = Path(tempfile.mkdtemp(prefix="pagoda-model-meta-"))
    os.chmod(path, 0o700)
    _metadata_dirs.append((os.getpid(), path))
    return path


def _write_private(root: Path, name: str, data: bytes) -> None:
    target = root / name
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _proc_path(fd: int) -> Path:
    return Path(f"/proc/self/fd/{fd}")


def resolve_encrypted_model(name: str, path: Path, key_file: str | os.PathLike | None = None,
                            key_env: str = KEY_ENV) -> ModelFiles:
    """``ModelFiles`` for a container: its key and header checked, its metadata members (never its
    weights) decrypted into a private directory (``private_metadata_dir``). For a GGUF container made
    by an older converter, the metadata is converted again from the GGUF decrypted into memory."""
    from pagoda.loader.resolve import ModelFiles

    key_path = Path(os.path.expanduser(str(key_file))).absolute() if key_file is not None else None
    key = load_key(key_path, key_env)
    with EncryptedModelReader(path, key) as reader:
        meta_dir = private_metadata_dir()
        try:
            _decrypt_metadata(reader, meta_dir)
        except BaseException:
            shutil.rmtree(meta_dir, ignore_errors=True)
            raise
        digest = reader.header_digest.hex()
        fmt = reader.format
    encryption = EncryptedModel(Path(path).absolute(), fmt, key_path, key_env, digest)
    return ModelFiles(name, meta_dir, encryption=encryption)


def _decrypt_metadata(reader: EncryptedModelReader, meta_dir: Path) -> None:
    names = {m.name for m in reader.members}
    for m in reader.members:
        if not is_weight_member(m.name):
            _write_private(meta_dir, m.name, reader.read_member(m))
    if reader.format == "safetensors":
        if "config.json" not in names:
            raise _corrupted(reader.path, "the model has no config.json")
        return
    from pagoda.loader.gguf import _CONVERTER_VERSION, convert_gguf_metadata

    if (reader.gguf_converter_version == _CONVERTER_VERSION and {"config.json", "tokenizer.json"} <= names):
        return
    fd = reader.decrypt_to_memfd(_gguf_member(reader))
    try:
        convert_gguf_metadata(_proc_path(fd), meta_dir)
    finally:
        os.close(fd)


def _gguf_member(reader: EncryptedModelReader) -> Member:
    ggufs = [m for m in reader.members if m.name.endswith(".gguf")]
    if len(ggufs) != 1:
        raise _corrupted(reader.path, f"a GGUF container holds one .gguf member, found {len(ggufs)}")
    return ggufs[0]


def _safetensors_members(reader: EncryptedModelReader) -> list[Member]:
    by_name = {m.name: m for m in reader.members}
    index = by_name.get("model.safetensors.index.json")
    if index is not None:
        try:
            shards = sorted(set(json.loads(reader.read_member(index))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{reader.path}: model.safetensors.index.json is not a valid safetensors index: {e}") from None
        missing = [s for s in shards if s not in by_name]
        if missing:
            raise ValueError(f"{reader.path}: safetensors shards listed in the index are missing: {', '.join(missing)}")
        return [by_name[s] for s in shards]
    members = [m for m in reader.members if m.name.endswith(".safetensors") and "/" not in m.name]
    if not members:
        raise ValueError(f"{reader.path}: no *.safetensors weights in the encrypted model")
    return members


def open_encrypted_weights(files: ModelFiles, hf_config: dict, *, keep_quantized: bool = False,
                           narrow=None) -> Iterator[tuple[str, Any]]:
    """The weights of an encrypted model, as ``iter_gguf_weights`` / ``iter_safetensors_weights``
    yield them. Every weight member is decrypted into memory and authenticated here, before this
    returns, so a wrong key or a tampered chunk is a ValueError before any tensor is loaded."""
    enc = files.encryption
    key = enc.key()
    with EncryptedModelReader(enc.container, key) as reader:
        if enc.header_sha256 and reader.header_digest.hex() != enc.header_sha256:
            raise ValueError(f"{enc.container} changed after it was opened (a different encrypted model)")
        members = [_gguf_member(reader)] if reader.format == "gguf" else _safetensors_members(reader)
        fds: list[int] = []
        try:
            for m in members:
                fds.append(reader.decrypt_to_memfd(m))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        fmt = reader.format
    return iter(_DecryptedWeights(fmt, fds, hf_config, keep_quantized, narrow))


class _DecryptedWeights:
    """Iterates the weights of the decrypted members (memfds), then closes the descriptors; the
    mappings the readers made keep their memory as long as tensors use it."""

    def __init__(self, fmt: str, fds: list[int], hf_config: dict, keep_quantized: bool, narrow) -> None:
        self._fmt, self._fds, self._hf_config = fmt, fds, hf_config
        self._keep_quantized, self._narrow = keep_quantized, narrow

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        try:
            paths = [_proc_path(fd) for fd in self._fds]
            if self._fmt == "gguf":
                from pagoda.loader.gguf import iter_gguf_weights

                yield from iter_gguf_weights(paths[0], self._hf_config, keep_quantized=self._keep_quantized,
                                             narrow=self._narrow)
            else:
                from pagoda.loader.safetensors import iter_safetensors_weights

                for i, path in enumerate(paths):  # each shard's memory goes back once it is read
                    yield from iter_safetensors_weights(None, narrow=self._narrow, files=[path])
                    os.close(self._fds[i])
                    self._fds[i] = -1
        finally:
            self.close()

    def close(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            if fd >= 0:
                os.close(fd)

    def __del__(self) -> None:
        self.close()


def container_summary(path: str | os.PathLike, key: ModelKey) -> dict[str, Any]:
    """Format, chunk size, KDF and members of a container (its key and header checked)."""
    with EncryptedModelReader(path, key) as reader:
        return {"format": reader.format, "chunk_size": reader.chunk_size, "kdf": reader.kdf["name"],
                "members": [(m.name, m.size) for m in reader.members]}

