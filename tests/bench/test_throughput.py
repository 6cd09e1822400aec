"""`pagoda bench throughput` as a user runs it, with the transformers baseline in the same run."""

from __future__ import annotations

import json

import pytest

from pagoda.bench import sweep
from pagoda.cli import main


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


def test_speculative_decoding_figures_are_printed_and_saved(tiny_llama, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    spec = json.dumps({"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 3,
                       "adaptive": False})
    code = main(["bench", "throughput", "--model", str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "0.02",
                 "--num-prompts", "2", "--input-len", "20", "--output-len", "16", "--backend", "pagoda",
                 "--speculative-config", spec, "--save-result", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and "Speculative Decoding" in printed and "Acceptance per position: 1.00, 1.00, 1.00" in printed
    s = json.loads(out.read_text())["results"][0]["spec_decode"]
    assert s["acceptance_rate"] == 1.0 and s["mean_accepted_length"] == pytest.approx(4.0, abs=0.5)
    assert s["draft_seconds"] > 0 and s["verify_seconds"] > 0


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
