"""`pagoda serve`'s options for keys, roles, the audit log, slow clients and the model store's
uploads (argparse only: the parser stays import-light; pagoda/security/access.py and
pagoda/entrypoints/ollama/store_routes.py build what they ask for)."""

from __future__ import annotations

import argparse

DEFAULT_READ_TIMEOUT = 30.0
DEFAULT_MAX_BLOB_GIB = 64.0  # a 70B model's GGUF fits
DEFAULT_BLOB_GRACE = 3600.0  # seconds from an `ollama create`'s upload to its create


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("access: keys, tenants, roles, audit (README.md, \"Security\")")
    g.add_argument("--auth-config", default=None, metavar="FILE",
                   help="API keys of tenants under roles (models, rate limits, max_tokens, priority), YAML or JSON; "
                        "keys are written by `pagoda keys add FILE ...`; SIGHUP reloads it. Replaces --api-key")
    g.add_argument("--audit-log", default=None, metavar="FILE",
                   help="one JSON line per request (tenant, key id, model, status, tokens, latency, filter hits); "
                        "no prompt or output text unless --audit-log-content")
    g.add_argument("--audit-log-content", action="store_true",
                   help="also write the prompts' and outputs' text to the audit log")
    g.add_argument("--audit-log-max-bytes", type=int, default=100 * 1024 * 1024,
                   help="rotate the audit log when it would pass this size")
    g.add_argument("--audit-log-backups", type=int, default=5, help="rotated audit logs kept (FILE.1 ... FILE.N)")
    g.add_argument("--read-timeout", type=float, default=DEFAULT_READ_TIMEOUT,
                   help="seconds a client gets to send a request's headers, and again its body; a slower one "
                        "(slowloris) is cut off (0: no limit)")
    g = p.add_argument_group("model store uploads (Ollama's /api/blobs; an admin's with --auth-config)")
    g.add_argument("--max-blob-size", type=float, default=DEFAULT_MAX_BLOB_GIB, metavar="GIB",
                   help="GiB one uploaded blob may take; a larger upload is refused (413) and nothing of it kept")
    g.add_argument("--blob-grace", type=float, default=DEFAULT_BLOB_GRACE, metavar="SECONDS",
                   help="blobs no model uses (an upload never named by /api/create) are deleted once this old: at "
                        "start-up, before each upload and after each create, as Ollama prunes (-1: never, as "
                        "OLLAMA_NOPRUNE)")
