"""The documentation: the site (mkdocs.yml, docs/) builds with `mkdocs build --strict`, so a broken
link, a missing page or a missing anchor fails the suite; README.md and docs/architecture.md stay
short; the README keeps the commands that .ci/run runs; and docs/architecture.md's layer diagram
names exactly the modules of pyproject's layers contract, layer by layer, in the same order."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS_CONTRACT = "apps over serving over engine"
README_MAX_LINES = 250
ARCHITECTURE_MAX_LINES = 400
SERVE_COMMAND = "pip install torch==2.13.0 -e . && pagoda serve"
TEST_COMMAND = "pip install torch==2.13.0 -e '.[test]' && python -m pytest -q -n 2 --dist loadfile"


# -- the layer diagram -----------------------------------------------------------------------------
def contract_layers(pyproject: dict) -> list[list[str]]:
    """The modules of each layer of the layers contract, highest layer first, in the file's order."""
    contracts = pyproject["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["name"] == LAYERS_CONTRACT)["layers"]
    return [[name.strip() for name in re.split(r"[:|]", layer) if name.strip()] for layer in layers]


SUBGRAPH = re.compile(r'^subgraph\s+(\w+)\s*\["([^"]+)"\]$')
NODE = re.compile(r'^(\w+)\["([^"]+)"\]$')


def diagram_layers(markdown: str) -> list[tuple[str, list[str]]]:
    """The layers of the mermaid block that holds a `%% layers` comment: (title, node labels) for
    each `subgraph ID ["title"]`, top to bottom, its nodes `ID["label"]` in the order they are
    written. Other lines (comments, `direction`, links between nodes or layers) are layout.
    Raises ValueError where the diagram is not in that form."""
    blocks = [b for b in re.findall(r"^```mermaid\n(.*?)^```", markdown, re.S | re.M) if "%% layers" in b]
    if len(blocks) != 1:
        raise ValueError(f"expected one mermaid block with a '%% layers' comment, found {len(blocks)}")
    layers: list[tuple[str, list[str]]] = []
    current: list[str] | None = None
    for raw in blocks[0].splitlines():
        line = raw.strip()
        if not line or line.startswith("%%"):
            continue
        if m := SUBGRAPH.match(line):
            if current is not None:
                raise ValueError(f"subgraph inside a layer: {line!r}")
            current = []
            layers.append((m.group(2), current))
        elif line == "end":
            if current is None:
                raise ValueError("'end' outside a subgraph")
            current = None
        elif m := NODE.match(line):
            if current is None:
                raise ValueError(f"a module outside every layer: {line!r}")
            current.append(m.group(2))
        elif "[" in line or "(" in line:
            raise ValueError(f"a line that is neither a module, a layer nor a link: {line!r}")
    if current is not None:
        raise ValueError("a subgraph without 'end'")
    return layers


def layer_diagram_errors(markdown: str, pyproject: dict) -> list[str]:
    """Where the diagram and the contract differ ([] when they agree)."""
    try:
        drawn = diagram_layers(markdown)
    except ValueError as e:
        return [str(e)]
    contract = contract_layers(pyproject)
    errors = []
    if len(drawn) != len(contract):
        errors.append(f"the diagram draws {len(drawn)} layers, the contract has {len(contract)}")
    for i, ((title, modules), expected) in enumerate(zip(drawn, contract)):
        if modules != expected:
            missing = [m for m in expected if m not in modules]
            extra = [m for m in modules if m not in expected]
            detail = f"missing {missing}, extra {extra}" if missing or extra else "same modules, another order"
            errors.append(f"layer {i + 1} ({title!r}) differs from the contract's: {detail}")
    return errors


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _architecture() -> str:
    return (ROOT / "docs" / "architecture.md").read_text()


def test_the_layer_diagram_names_the_contracts_modules():
    assert layer_diagram_errors(_architecture(), _pyproject()) == []
    assert [len(modules) for _, modules in diagram_layers(_architecture())] == [
        len(layer) for layer in contract_layers(_pyproject())]


def test_a_diagram_out_of_step_with_the_contract_is_caught():
    text, pyproject = _architecture(), _pyproject()
    first, second = contract_layers(pyproject)[2][:2]  # two engine modules, next to each other
    doctored = {
        "a module dropped": re.sub(rf'^\s*\w+\["{re.escape(first)}"\]\n', "", text, count=1, flags=re.M),
        "two modules swapped": text.replace(f'"{first}"', '"@@"').replace(f'"{second}"', f'"{first}"')
                                   .replace('"@@"', f'"{second}"'),
        "a module added": text.replace(f'["{first}"]', f'["{first}"]\n        m_extra["pagoda.extra"]', 1),
        "a module moved to another layer": text.replace(
            f'["{first}"]', '["pagoda.placeholder"]', 1).replace(
            '["pagoda.cli"]', f'["pagoda.cli"]\n        m_moved["{first}"]', 1),
        "two layers swapped": _swap_first_two_subgraphs(text),
        "a layer missing": re.sub(r'^\s*subgraph apps .*?^\s*end\n', "", text, count=1, flags=re.M | re.S),
        "no layer diagram": text.replace("%% layers", "%% stages"),
        "a module outside the layers": text.replace(
            "    apps -->|imports|", '    stray["pagoda.stray"]\n    apps -->|imports|', 1),
    }
    for what, copy in doctored.items():
        assert copy != text, what  # the doctoring took
        assert layer_diagram_errors(copy, pyproject), what
    # and the other way: the contract changes, the diagram does not
    changed = _pyproject()
    layers = next(c for c in changed["tool"]["importlinter"]["contracts"] if c["name"] == LAYERS_CONTRACT)["layers"]
    layers[1] += " : pagoda.newcomer"
    assert layer_diagram_errors(text, changed) == [
        "layer 2 ('serving') differs from the contract's: missing ['pagoda.newcomer'], extra []"]


def _swap_first_two_subgraphs(text: str) -> str:
    blocks = list(re.finditer(r'^\s*subgraph .*?^\s*end\n', text, re.M | re.S))
    a, b = blocks[0], blocks[1]
    return text[:a.start()] + b.group(0) + text[a.end():b.start()] + a.group(0) + text[b.end():]


# -- lengths, commands, links --------------------------------------------------------------------
def test_readme_and_architecture_stay_short():
    readme = (ROOT / "README.md").read_text().splitlines()
    architecture = _architecture().splitlines()
    assert len(readme) <= README_MAX_LINES, f"README.md has {len(readme)} lines: move detail into docs/"
    assert len(architecture) <= ARCHITECTURE_MAX_LINES, (
        f"docs/architecture.md has {len(architecture)} lines: move detail into docs/internals/")


def test_the_readme_keeps_the_commands_that_ci_runs():
    readme = (ROOT / "README.md").read_text()
    quickstart = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    assert f"```bash\n{SERVE_COMMAND}\n```" in quickstart
    assert f"```bash\n{TEST_COMMAND}\n```" in quickstart
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text().splitlines()


def test_the_readmes_relative_links_resolve():
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert any(t.startswith("docs/images/") for t in targets)  # the screenshots stay shown
    broken = []
    for target in targets:
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        if not (ROOT / target.split("#", 1)[0]).exists():
            broken.append(target)
    assert broken == []


def test_the_site_builds_strict(tmp_path):
    """mkdocs.yml says strict (warnings fail) and validates links, anchors and pages left out of
    the navigation; the build runs offline (no web fonts, no plugin that fetches)."""
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    architecture = (site / "architecture" / "index.html").read_text()
    assert architecture.count('class="mermaid"') >= 2  # the diagrams reach the page as mermaid
    benchmarks = (site / "benchmarks" / "index.html").read_text()
    assert "Latest numbers" in benchmarks and "History" in benchmarks  # benchmarks/README.md, included
    assert benchmarks.index("Latest numbers") < benchmarks.index("History")
