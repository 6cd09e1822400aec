"""`pagoda bench throughput` as a user runs it, with the transformers baseline in the same run."""

from __future__ import annotations

import json

import pytest

from pagoda.bench import sweep
from pagoda.entrypoints.cli import main


def test_cli_prints_throughput_and_writes_json(tiny_llama, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    code = main(["bench", "throughput", "--model", str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "0.02",
                 "--num-prompts", "4", "--input-len", "20", "--output-len", "6", "--backend", "pagoda,hf,llamacpp",
                 "--hf-batch-sizes", "1,4", "--serial-prompts", "2", "--save-result", str(out)])
    printed = capsys.readouterr()
    assert code == 0
    assert "pagoda: " in printed.out and "requests/s" in printed.out and "output tokens/s" in printed.out
    assert "skipping llamacpp: llama.cpp needs a GGUF model" in printed.err  # a missing baseline is a message
    record = json.loads(out.read_text())
    by_label = {r["label"]: r for r in record["results"]}
    assert set(by_label) == {"pagoda", "transformers batch 1", "transformers batch 4"}
    p = by_label["pagoda"]
    assert (p["requests"], p["input_tokens"], p["output_tokens"]) == (4, 80, 24)
    assert abs(p["output_tokens_per_s"] * p["elapsed_s"] - 24) < 1e-6
    assert by_label["transformers batch 1"]["requests"] == 2 and by_label["transformers batch 4"]["requests"] == 4
    assert "llamacpp" in record["skipped"]


def test_max_concurrency_is_the_largest_passing_level():
    levels = [{"max_concurrency": c, "failed": 0, "completed": c, "slo_attainment": a}
              for c, a in ((1, 1.0), (4, 1.0), (16, 0.5), (64, 0.2))]
    assert sweep.max_concurrency_meeting(levels, 0.99) == 4
    assert sweep.max_concurrency_meeting(levels, 0.5) == 16
    assert sweep.max_concurrency_meeting(levels[2:], 0.99) is None
    levels[1]["failed"] = 1
    assert sweep.max_concurrency_meeting(levels, 0.99) == 1
    assert sweep.parse_levels("16,1,4,4") == [1, 4, 16]


def test_llamacpp_baseline_on_a_gguf(tiny_llama, tmp_path, capsys):
    """Where llama-cpp-python is installed, the llama.cpp baseline runs the GGUF pagoda loads."""
    pytest.importorskip("llama_cpp")
    from gguf_export import export_gguf

    gguf = export_gguf(tiny_llama, tmp_path / "tiny.gguf", "Q8_0")
    out = tmp_path / "llamacpp.json"
    code = main(["bench", "throughput", "--model", str(gguf), "--backend", "llamacpp", "--num-prompts", "3",
                 "--input-len", "12", "--output-len", "5", "--serial-prompts", "2", "--threads", "1",
                 "--save-result", str(out)])
    assert code == 0, capsys.readouterr().err
    (r,) = json.loads(out.read_text())["results"]
    assert r["label"] == "llama.cpp (one request at a time)" and r["threads"] == 1
    assert (r["requests"], r["input_tokens"], r["output_tokens"]) == (2, 24, 10)
