"""pagoda/envs.py: every PAGODA_* variable the package reads is declared there, with a comment
saying what it does, and read at each access."""

from __future__ import annotations

import re
from pathlib import Path

from pagoda import envs

ROOT = Path(__file__).resolve().parent.parent


def test_every_variable_the_package_names_is_declared_in_envs():
    named = set()
    for path in (ROOT / "pagoda").rglob("*.py"):
        named |= set(re.findall(r"\bPAGODA_[A-Z0-9_]+\b", path.read_text()))
    named -= {"PAGODA_CONTENT_MARK"}  # a placeholder written into a chat template (lang/endpoint.py), not a variable
    assert named - set(envs.VARIABLES) == set()


def test_each_variable_is_documented_where_it_is_declared():
    source = (ROOT / "pagoda" / "envs.py").read_text().splitlines()
    for name in envs.VARIABLES:
        line = next(i for i, text in enumerate(source) if text.strip().startswith(f'"{name}":'))
        while source[line - 1].strip().startswith('"PAGODA_'):  # a group of variables under one comment
            line -= 1
        assert source[line - 1].strip().startswith("#"), name


def test_variables_are_read_at_access(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGODA_HOME", str(tmp_path))
    assert envs.PAGODA_HOME == tmp_path
    monkeypatch.setenv("PAGODA_PACK_WEIGHTS", "0")
    assert envs.PAGODA_PACK_WEIGHTS is False
    monkeypatch.delenv("PAGODA_PACK_WEIGHTS")
    assert envs.PAGODA_PACK_WEIGHTS is True
    monkeypatch.delenv("PAGODA_API_KEY", raising=False)
    assert envs.PAGODA_API_KEY is None
