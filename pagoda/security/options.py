"""`pagoda serve`'s options for keys, roles, the audit log and slow clients (argparse only: the
parser stays import-light; pagoda/security/access.py builds what they ask for)."""

from __future__ import annotations

import argparse

DEFAULT_READ_TIMEOUT = 30.0


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
