"""pagoda's layers (pyproject's [tool.importlinter], docs/architecture.md "Layers"): the import
contracts hold, no module is left out of the layers, and no import cycle exists among pagoda's
modules, imports inside functions counted (grimp sees them)."""

from __future__ import annotations

import ast
import logging
import pkgutil
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
from importlinter.cli import lint_imports

import pagoda

ROOT = Path(__file__).resolve().parent.parent


def _layer_modules() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in config["contracts"] if c["type"] == "layers")["layers"]
    return {name.strip() for layer in layers for name in layer.replace("|", ":").split(":")}


def test_the_import_contracts_hold(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    # import-linter's CLI configures logging with dictConfig, which disables every logger that
    # exists then: pagoda's, imported by the test modules collected before; a later test in this
    # process that reads a log line (caplog) would find nothing. Their state is put back after.
    loggers = [lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    disabled = {lg: lg.disabled for lg in loggers}
    try:
        code = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True)
    finally:
        for lg, was in disabled.items():
            lg.disabled = was
    assert code == 0, capsys.readouterr().out  # the broken contract and the import chain that breaks it


def test_every_module_is_in_a_layer():
    """A new top-level module or package must be placed in a layer (else no contract checks it)."""
    top_level = {f"pagoda.{m.name}" for m in pkgutil.iter_modules(pagoda.__path__) if m.name != "csrc"}
    assert top_level - _layer_modules() == set()
    assert _layer_modules() - top_level == set()  # and the layers name only what exists


def _strongly_connected(graph: grimp.ImportGraph) -> list[set[str]]:
    """Tarjan's components of the module graph with more than one module (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return components


def test_no_import_cycles():
    graph = grimp.build_graph("pagoda", cache_dir=None)
    cycles = _strongly_connected(graph)
    details = []
    for component in cycles:
        for importer in sorted(component):
            for imported in sorted(graph.find_modules_directly_imported_by(importer) & component):
                line = graph.get_import_details(importer=importer, imported=imported)[0]
                details.append(f"{importer} -> {imported} (line {line['line_number']}: {line['line_contents']})")
    assert not cycles, "import cycles:\n" + "\n".join(details)


def test_the_cycle_finder_finds_a_planted_cycle(tmp_path, monkeypatch):
    """The finder sees a cycle closed by an import inside a function."""
    (tmp_path / "planted").mkdir()
    (tmp_path / "planted" / "__init__.py").write_text("")
    (tmp_path / "planted" / "a.py").write_text("def f():\n    from planted import b\n")
    (tmp_path / "planted" / "b.py").write_text("from planted import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("planted", cache_dir=None)
    assert _strongly_connected(graph) == [{"planted.a", "planted.b"}]


def _function_local_imports(path: Path) -> list[tuple[int, str]]:
    """(line, source) of the imports inside functions, TYPE_CHECKING blocks aside."""
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    found = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append((node.lineno, lines[node.lineno - 1]))
    return sorted(set(found))


def test_an_import_inside_a_function_says_why():
    """An import stays inside a function only to defer something (a heavy or optional package, or
    a module the `pagoda` command must not load at start), and a comment on it says so."""
    unexplained = []
    for path in sorted((ROOT / "pagoda").rglob("*.py")):
        if path.name.endswith("_pb2.py") or path.name.endswith("_pb2_grpc.py"):
            continue  # generated by grpc_tools
        lines = path.read_text().splitlines()
        for number, line in _function_local_imports(path):
            above = lines[number - 2].strip() if number > 1 else ""
            if "#" not in line and not above.startswith("#"):
                unexplained.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not unexplained, "imports inside functions without a comment saying why:\n" + "\n".join(unexplained)


def test_serving_one_model_imports_no_optional_executor():
    """Ray (the `ray` extra) loads only for --distributed-executor-backend ray: the server and the
    engine core import without it."""
    code = ("import sys, pagoda.engine.core, pagoda.entrypoints.openai.api_server; "
            "print(sorted(m for m in ('ray',) if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
