"""API keys, tenants and roles: the `--auth-config` file, and the keys in it.

The file (YAML, or JSON when its name ends in .json) has two sections and one switch:

    roles:
      basic:
        models: ["tiny", "smollm2*"]     # globs of the model names the role may use
        requests_per_second: 5            # token bucket; burst: its size (default: max(1, rate))
        max_concurrent: 2                 # requests at once
        tokens_per_minute: 20000          # prompt + completion, sliding 60 s window
        max_tokens: 512                   # per choice: the default, and the most a request may ask
        priority: 0                       # the scheduler priority of the role's requests
      vip:
        models: ["*"]
        priority: 10
        admin: true                       # may change the model store (Ollama /api/pull, /api/delete, ...)
        moderation_words: [vip-terms.txt] # word lists added to the server's for this role (moderation.py;
                                          # relative to this file)
    keys:                                 # written by `pagoda keys add FILE --tenant T --role R`
      - {id: 3f9c0a1b2d4e, tenant: acme, role: basic, hash: "sha256:<salt>:<digest>", created: "..."}
    isolate_prefix_cache: true            # each tenant's requests get their own prefix-cache salt

Every limit is optional (absent: no limit). Limits are per (tenant, role) (security/limits.py).

A key is `pk-<id>-<secret>`: the id (12 hex characters) finds the entry, the secret (32 random
bytes, base64url) is checked against the stored hash. The file never holds the key, only
`sha256:<salt>:<HMAC-SHA256(salt, secret)>`. A fast hash is enough here because the secret is
256 random bits, not a password: there is nothing to guess, so a slow KDF (scrypt) would only
cost every request its tens of milliseconds (benchmarks/README.md, "Auth overhead"). The
comparison is constant-time, and an unknown id costs the same hash as a wrong secret.

Import-light (no yaml until a file is read or written): `pagoda keys` and `pagoda serve
--help` import it.
"""

from __future__ import annotations

import base64
import fnmatch
import functools
import hmac
import json
import math
import os
import re
import secrets
import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

KEY_PREFIX = "pk"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # tenants and roles: no '/' (the cache salt)
_KEY_ID = re.compile(r"^[0-9a-f]{12}$")
_HASH = re.compile(r"^sha256:([0-9a-f]{32}):([0-9a-f]{64})$")
_ROLE_FIELDS = {"models", "requests_per_second", "burst", "max_concurrent", "tokens_per_minute", "max_tokens",
                "priority", "admin", "description", "moderation_words"}
_KEY_FIELDS = {"id", "tenant", "role", "hash", "created", "revoked", "name"}
_TOP_FIELDS = {"roles", "keys", "isolate_prefix_cache"}
_DUMMY_SALT, _DUMMY_DIGEST = bytes(16), bytes(32)  # an unknown id costs the same hash as a wrong secret


class AuthConfigError(ValueError):
    """The auth config file is missing, unreadable or invalid; the message says where."""


@dataclass(frozen=True)
class Role:
    name: str
    models: tuple[str, ...]
    requests_per_second: float | None = None
    burst: float | None = None
    max_concurrent: int | None = None
    tokens_per_minute: int | None = None
    max_tokens: int | None = None
    priority: int = 0
    admin: bool = False
    description: str | None = None
    moderation_words: tuple[str, ...] = ()  # word-list files (security/moderation.py), absolute paths

    @property
    def bucket_size(self) -> float:
        return self.burst if self.burst is not None else max(1.0, self.requests_per_second or 1.0)

    def may_use(self, model: str) -> bool:
        return _globs(self.models).match(model) is not None


@dataclass(frozen=True)
class KeyEntry:
    id: str
    tenant: str
    role: str
    hash: str
    created: str | None = None
    revoked: str | None = None
    name: str | None = None

    def to_dict(self) -> dict:
        out = {"id": self.id, "tenant": self.tenant, "role": self.role, "hash": self.hash}
        for extra in ("created", "revoked", "name"):
            if getattr(self, extra) is not None:
                out[extra] = getattr(self, extra)
        return out


@dataclass
class AuthConfig:
    roles: dict[str, Role] = field(default_factory=dict)
    keys: dict[str, KeyEntry] = field(default_factory=dict)  # by id
    isolate_prefix_cache: bool = True

    # -- checking keys ---------------------------------------------------------------------------
    def __post_init__(self) -> None:
        self._hashes = {key_id: _parse_hash(entry.hash) for key_id, entry in self.keys.items()}  # (salt, digest)

    def authenticate(self, token: str) -> KeyEntry | None:
        """The active key entry `token` is, else None (unknown, wrong secret, revoked, malformed)."""
        key_id, secret = split_key(token)
        entry = self.keys.get(key_id) if key_id is not None else None
        salt, digest = self._hashes[key_id] if entry is not None else (_DUMMY_SALT, _DUMMY_DIGEST)
        computed = _digest(salt, secret or "")
        if not hmac.compare_digest(computed, digest) or entry is None or entry.revoked is not None:
            return None
        return entry

    # -- reading and writing ---------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data, where: str = "auth config", base: Path | None = None) -> AuthConfig:
        """`base`: the directory relative paths in the file (moderation_words) are relative to."""
        data = _mapping({} if data is None else data, _TOP_FIELDS, where,
                        "the top level must be a mapping with `roles:` and `keys:`", "unknown top-level field(s)")
        roles_data = data.get("roles") or {}
        if not isinstance(roles_data, dict):
            raise AuthConfigError(f"{where}: `roles` must map role names to their settings")
        roles = {str(name): _role(str(name), spec, where, base) for name, spec in roles_data.items()}
        keys_data = data.get("keys") or []
        if not isinstance(keys_data, list):
            raise AuthConfigError(f"{where}: `keys` must be a list")
        keys: dict[str, KeyEntry] = {}
        for i, spec in enumerate(keys_data):
            entry = _key(spec, f"{where}: keys[{i}]")
            if entry.role not in roles:
                raise AuthConfigError(f"{where}: keys[{i}] (id {entry.id}) has role `{entry.role}`, which `roles` "
                                      f"does not define (roles: {', '.join(sorted(roles)) or 'none'})")
            if entry.id in keys:
                raise AuthConfigError(f"{where}: keys[{i}]: the id {entry.id} appears twice")
            keys[entry.id] = entry
        isolate = data.get("isolate_prefix_cache", True)
        if not isinstance(isolate, bool):
            raise AuthConfigError(f"{where}: isolate_prefix_cache must be true or false")
        return cls(roles, keys, isolate)

    @classmethod
    def load(cls, path: str | os.PathLike) -> AuthConfig:
        path = Path(path)
        return cls.from_dict(read_file(path), str(path), path.resolve().parent)


def read_file(path: str | os.PathLike):
    """The auth config file's data as written (YAML, or JSON for *.json); AuthConfigError if it
    cannot be read or parsed."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise AuthConfigError(f"cannot read the auth config {path}: {e.strerror or e}") from None
    return _parse(text, path)


def write_file(path: str | os.PathLike, data: dict) -> None:
    """Write the file's data in its format (JSON for *.json, else YAML), atomically (a server
    reloading on SIGHUP reads the old file or the new one, never half of one), keeping its
    permission bits (0600 for a new file). Comments in a YAML file are not kept."""
    path = Path(path)
    if path.suffix.lower() == ".json":
        text = json.dumps(data, indent=2) + "\n"
    else:
        import yaml  # deferred: yaml loads on first use

        text = yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=120, allow_unicode=True)
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o600
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# -- keys --------------------------------------------------------------------------------------
def new_key(taken=()) -> tuple[str, str, str]:
    """A new key: (key id, the key to hand out, the hash to store)."""
    while True:
        key_id = secrets.token_hex(6)
        if key_id not in taken:
            break
    secret = base64.urlsafe_b64encode(secrets.token_bytes(32)).decode().rstrip("=")
    return key_id, f"{KEY_PREFIX}-{key_id}-{secret}", hash_secret(secret)


def hash_secret(secret: str, salt: bytes | None = None) -> str:
    salt = secrets.token_bytes(16) if salt is None else salt
    return f"sha256:{salt.hex()}:{_digest(salt, secret).hex()}"


def split_key(token: str) -> tuple[str | None, str | None]:
    """`pk-<id>-<secret>` → (id, secret); (None, None) when it is not of that form."""
    parts = token.split("-", 2)
    if len(parts) != 3 or parts[0] != KEY_PREFIX or len(parts[1]) != 12 or not _KEY_ID.match(parts[1]) \
            or not parts[2]:
        return None, None
    return parts[1], parts[2]


def _digest(salt: bytes, secret: str) -> bytes:
    return hmac.digest(salt, secret.encode("utf-8", "surrogatepass"), "sha256")


def _parse_hash(text: str) -> tuple[bytes, bytes]:
    m = _HASH.match(text)
    return bytes.fromhex(m.group(1)), bytes.fromhex(m.group(2))


@functools.lru_cache(maxsize=256)
def _globs(patterns: tuple[str, ...]) -> re.Pattern:
    """A role's model globs as one regex (fnmatch's, case-sensitive); matches nothing for none."""
    return re.compile("|".join(fnmatch.translate(p) for p in patterns) or r"(?!)")


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


# -- validation ------------------------------------------------------------------------------
def _parse(text: str, path: Path):
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text) if text.strip() else {}
        except ValueError as e:
            raise AuthConfigError(f"{path}: not valid JSON: {e}") from None
    import yaml  # deferred: yaml loads on first use

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise AuthConfigError(f"{path}: not valid YAML: {e}") from None


def _number(spec: dict, name: str, where: str, *, integer: bool, minimum: float, allow_zero: bool = False):
    value = spec.get(name)
    if value is None:
        return None
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or not math.isfinite(value) or value < minimum or (value == 0 and not allow_zero):
        kind = "an integer" if integer else "a number"
        raise AuthConfigError(f"{where}: {name} must be {kind} >= {minimum:g}{'' if allow_zero else ' and > 0'}, "
                              f"got {value!r}")
    return value


def _role(name: str, spec, where: str, base: Path | None = None) -> Role:
    here = f"{where}: roles.{name}"
    if not _NAME.match(name):
        raise AuthConfigError(f"{here}: a role name is 1-64 letters, digits or . _ -")
    spec = _mapping({} if spec is None else spec, _ROLE_FIELDS, here, "must be a mapping (models, limits)")
    models = spec.get("models", [])
    if isinstance(models, str):
        models = [models]
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        raise AuthConfigError(f"{here}: models must be a list of model-name globs")
    priority = spec.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) > 2**31:
        raise AuthConfigError(f"{here}: priority must be an integer, got {priority!r}")
    admin = spec.get("admin", False)
    if not isinstance(admin, bool):
        raise AuthConfigError(f"{here}: admin must be true or false")
    lists = spec.get("moderation_words") or []
    if isinstance(lists, str):
        lists = [lists]
    if not isinstance(lists, list) or not all(isinstance(x, str) and x for x in lists):
        raise AuthConfigError(f"{here}: moderation_words must be a list of word-list files")
    lists = [str(base / x) if base is not None and not Path(x).is_absolute() else x for x in lists]
    rate = _number(spec, "requests_per_second", here, integer=False, minimum=0)
    burst = _number(spec, "burst", here, integer=False, minimum=1)
    if burst is not None and rate is None:
        raise AuthConfigError(f"{here}: burst needs requests_per_second")
    return Role(name, tuple(models), rate, burst,
                _number(spec, "max_concurrent", here, integer=True, minimum=1),
                _number(spec, "tokens_per_minute", here, integer=True, minimum=1),
                _number(spec, "max_tokens", here, integer=True, minimum=1),
                priority, admin, spec.get("description"), tuple(lists))


def _mapping(spec, allowed: set[str], where: str, not_a_mapping: str,
             unknown_what: str = "unknown field(s)") -> dict:
    """`spec` if it is a mapping of `allowed` fields only, else the AuthConfigError naming what is wrong."""
    if not isinstance(spec, dict):
        raise AuthConfigError(f"{where}: {not_a_mapping}")
    unknown = set(spec) - allowed
    if unknown:
        raise AuthConfigError(f"{where}: {unknown_what} {sorted(unknown)}; expected {sorted(allowed)}")
    return spec


def _key(spec, where: str) -> KeyEntry:
    _mapping(spec, _KEY_FIELDS, where, "must be a mapping (id, tenant, role, hash)")
    missing = [f for f in ("id", "tenant", "role", "hash") if spec.get(f) is None or spec.get(f) == ""]
    if missing:
        raise AuthConfigError(f"{where}: missing {', '.join(missing)}")
    key_id, tenant, role, digest = (str(spec[f]) for f in ("id", "tenant", "role", "hash"))
    if not _KEY_ID.match(key_id):
        raise AuthConfigError(f"{where}: id must be a string of 12 hex characters (as `pagoda keys add` writes; "
                              f"quote it in YAML), got {spec['id']!r}")
    if not _NAME.match(tenant):
        raise AuthConfigError(f"{where}: tenant must be 1-64 letters, digits or . _ -, got {tenant!r}")
    if not _HASH.match(digest):
        raise AuthConfigError(f"{where}: hash must be sha256:<32 hex salt>:<64 hex digest> (as `pagoda keys add` "
                              "writes); the file never holds a key itself")
    extra = {f: (str(spec[f]) if spec.get(f) not in (None, False) else None) for f in ("created", "revoked", "name")}
    return KeyEntry(key_id, tenant, role, digest, **extra)
