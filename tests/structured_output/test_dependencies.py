"""Structured output needs neither xgrammar nor triton (about 1 GB installed): pagoda does not
require them, and a constrained generation runs without importing them (or transformers)."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PROGRAM = """
import json, sys
from pagoda import LLM, SamplingParams
from pagoda.sampling_params import StructuredOutputsParams as SO
llm = LLM(model=sys.argv[1], dtype="float32", kv_cache_memory=0.02)
schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
out = llm.generate(["Hello"], SamplingParams(max_tokens=20, temperature=1.0, seed=0,
                   structured_outputs=SO(json=schema)), use_tqdm=False)[0].outputs[0]
heavy = sorted(m for m in ("triton", "xgrammar", "transformers") if m in sys.modules)
print(json.dumps({"text": out.text, "finish": out.finish_reason, "imported": heavy}))
"""


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9._-]+", r).group().lower() for r in requirements}


def test_pagoda_requires_llguidance_not_xgrammar_or_triton():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = _requirement_names(project["dependencies"])
    assert "llguidance" in names and not names & {"xgrammar", "triton"}
    assert not importlib.metadata.requires("llguidance")  # and llguidance itself needs nothing


def test_a_constrained_generation_imports_no_triton(tiny_llama):
    done = subprocess.run([sys.executable, "-c", _PROGRAM, str(tiny_llama)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["imported"] == []
    assert result["finish"] == "stop" and json.loads(result["text"])["n"] in range(10)
