"""`pagoda keys`: the API keys of an `--auth-config` file.

    pagoda keys add auth.yaml --tenant acme --role basic      # prints the new key once, as the last line
    pagoda keys list auth.yaml                                 # id, tenant, role, created, state
    pagoda keys revoke auth.yaml 3f9c0a1b2d4e                  # by key id; the key stops working
    kill -HUP <server pid>                                     # a running server reloads the file

The file keeps only each key's id and a salted hash (security/auth.py), never the key: a key
that is lost cannot be shown again, only revoked and replaced. The roles must be in the file
already (`roles:`; see README.md, "Keys, tenants and roles"). The file is rewritten atomically
and keeps its mode (a new file is 0600); YAML comments are not kept. A revoked key stays in
the file, marked with the time, so `list` and the audit log can still name it.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import sys
from contextlib import contextmanager
from pathlib import Path


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("keys", help="add, list and revoke the API keys of an --auth-config file",
                       description=__doc__.split("The file keeps")[0].rstrip())
    verbs = p.add_subparsers(dest="keys_command", required=True)
    a = verbs.add_parser("add", help="make a new key for a tenant under a role (printed once, as the last line)")
    a.add_argument("file", help="the auth config (YAML, or JSON for *.json), with the role in `roles:`")
    a.add_argument("--tenant", required=True, help="who the key belongs to (1-64 letters, digits, . _ -)")
    a.add_argument("--role", required=True, help="a role of the file's `roles:`")
    a.add_argument("--name", default=None, help="a note kept with the key (e.g. where it is used)")
    a.set_defaults(func=run_add)
    ls = verbs.add_parser("list", help="the keys of the file (ids, never the keys)")
    ls.add_argument("file")
    ls.set_defaults(func=run_list)
    r = verbs.add_parser("revoke", help="revoke a key by its id (then SIGHUP a running server to apply it)")
    r.add_argument("file")
    r.add_argument("key_id", help="the key's id (`pagoda keys list`; the part after pk- in the key)")
    r.set_defaults(func=run_revoke)
    return p


@contextmanager
def _locked(path: Path):
    """One `pagoda keys` writer at a time per file (a lock file beside it)."""
    lock = path.with_name(f".{path.name}.lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _load(path: Path):
    from pagoda.security.auth import AuthConfig, read_file  # deferred: keeps `pagoda` light at start

    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: write its `roles:` first (README.md, \"Keys, tenants and "
                                "roles\")")
    data = read_file(path)
    config = AuthConfig.from_dict(data, str(path), path.resolve().parent)  # the file must be valid as it is
    return (data if isinstance(data, dict) else {}), config


def run_add(ns: argparse.Namespace) -> int:
    # deferred: keeps `pagoda` light at start
    from pagoda.security.auth import _NAME, KeyEntry, new_key, now_iso, write_file

    path = Path(ns.file)
    if not _NAME.match(ns.tenant):
        raise ValueError(f"--tenant must be 1-64 letters, digits or . _ -, got {ns.tenant!r}")
    with _locked(path):
        data, config = _load(path)
        if ns.role not in config.roles:
            raise ValueError(f"role {ns.role!r} is not in {path} (roles: {', '.join(sorted(config.roles)) or 'none'})")
        key_id, key, digest = new_key(taken=config.keys)
        entry = KeyEntry(key_id, ns.tenant, ns.role, digest, created=now_iso(), name=ns.name)
        data["keys"] = list(data.get("keys") or []) + [entry.to_dict()]
        write_file(path, data)
    print(f"added key {key_id} for tenant {ns.tenant} (role {ns.role}) to {path}. A running server takes it after "
          f"SIGHUP. The key is shown only now; the file keeps a hash of it:")
    print(key, flush=True)
    return 0


def run_list(ns: argparse.Namespace) -> int:
    path = Path(ns.file)
    _, config = _load(path)
    rows = [("ID", "TENANT", "ROLE", "CREATED", "STATE", "NAME")]
    for k in config.keys.values():
        rows.append((k.id, k.tenant, k.role, k.created or "-", f"revoked {k.revoked}" if k.revoked else "active",
                     k.name or ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    return 0


def run_revoke(ns: argparse.Namespace) -> int:
    from pagoda.security.auth import now_iso, split_key, write_file  # deferred: keeps `pagoda` light at start

    path = Path(ns.file)
    key_id = ns.key_id
    if key_id.startswith("pk-"):  # a whole key given: take its id, never echo the secret
        key_id = split_key(key_id)[0] or ""
    with _locked(path):
        data, config = _load(path)
        entry = config.keys.get(key_id)
        if entry is None:
            raise ValueError(f"no key with id {key_id!r} in {path} (`pagoda keys list {path}`)")
        if entry.revoked:
            print(f"key {key_id} (tenant {entry.tenant}) was already revoked at {entry.revoked}", file=sys.stderr)
            return 0
        for raw in data.get("keys") or []:
            if isinstance(raw, dict) and str(raw.get("id")) == key_id:
                raw["revoked"] = now_iso()
        write_file(path, data)
    print(f"revoked key {key_id} (tenant {entry.tenant}, role {entry.role}) in {path}; send SIGHUP to a running "
          "server to apply it (kill -HUP PID)")
    return 0
