"""Only the scheduler writes a `Request` (docs/architecture.md): the KV cache manager hands it
blocks (`KVBlocks`), the engine core hands it a grammar or a stop reason through the scheduler's
calls. This walks every module's syntax tree for writes to a request's fields elsewhere."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

from pagoda.request import Request

ROOT = Path(__file__).resolve().parents[2]
WRITERS = {"pagoda/core/scheduler.py", "pagoda/core/block_tables.py", "pagoda/request.py"}  # block_tables: the scheduler's
FIELDS = {f.name for f in dataclasses.fields(Request)} | {"all_token_ids"}
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "update", "add", "discard", "setdefault"}
# a variable that holds a request: annotated `Request`, or named after one
REQUEST_NAME = re.compile(r"^(req|request|requests?_\w+|\w+_request|r|child|victim|head|favored)$")


def _request_names(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = set()
    for arg in function.args.args + function.args.kwonlyargs:
        if arg.annotation is not None and "Request" in ast.unparse(arg.annotation).replace("RequestStatus", ""):
            names.add(arg.arg)
    for node in ast.walk(function):
        if isinstance(node, ast.Name) and REQUEST_NAME.match(node.id):
            names.add(node.id)
    return names


def _field_of_request(node: ast.expr, names: set[str]) -> str | None:
    """``request.field`` (or ``request.field[i]``) → the field, for a request variable."""
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and node.attr in FIELDS and isinstance(node.value, ast.Name) \
            and node.value.id in names:
        return node.attr
    return None


def request_writes(source: str) -> list[tuple[int, str]]:
    """(line, code) of each write to a request's field in ``source``."""
    found = []
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        names = _request_names(function)
        for node in ast.walk(function):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Delete):
                targets = node.targets
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                targets = [node.func.value]
            for target in targets:
                for part in ast.walk(target) if isinstance(target, ast.Tuple) else [target]:
                    if _field_of_request(part, names):
                        found.append((node.lineno, ast.unparse(node).splitlines()[0]))
    return sorted(set(found))


def test_only_the_scheduler_writes_a_request():
    writes = []
    for path in sorted((ROOT / "pagoda").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative in WRITERS or relative.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        writes += [f"{relative}:{line}: {code}" for line, code in request_writes(path.read_text())]
    assert not writes, "a Request written outside the scheduler:\n" + "\n".join(writes)


def test_the_check_sees_the_writes_it_forbids():
    """The writes this check was made for, as the KV manager and the engine core once made them."""
    source = '''
def match_prefix(self, request: Request, blocks):
    request.block_ids = list(blocks)
    request.num_computed_tokens += 16

def allocate_slots(self, request, new):
    request.block_ids.extend(new)
    request.group_block_ids[0] = []

def add_request(self, req):
    req.grammar, req.stop_reason = None, "why"

def not_a_request(self, sample, status):
    sample.stop_reason = "stop"  # an output's field of the same name
'''
    lines = [line for line, _ in request_writes(source)]
    assert lines == [3, 4, 7, 8, 11]
