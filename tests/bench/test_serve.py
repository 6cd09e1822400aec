"""`pagoda bench serve` against a real `pagoda serve` subprocess on the tiny model."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagoda.bench import datasets, serve, servers
from pagoda.cli import main
from pagoda.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def server(tiny_llama):
    port = servers.free_port()
    cmd = servers.pagoda_command(str(tiny_llama), port, "--dtype", "float32", "--kv-cache-memory", "0.02",
                                 "--served-model-name", "tiny")
    with servers.running(cmd, port, timeout_s=120) as base:
        yield base


def _bench(capsys, *args: str) -> tuple[int, str]:
    """`pagoda bench ...` through the CLI's entry point, in this process (the server is the subprocess)."""
    code = main(["bench", *args])
    return code, capsys.readouterr().out


def test_cli_run_completes_every_request(server, tiny_llama, tmp_path, capsys):
    out = tmp_path / "serve.json"
    code, stdout = _bench(capsys, "serve", "--base-url", server, "--model", "tiny", "--tokenizer", str(tiny_llama), "--num-prompts", "6",
                  "--input-len", "24", "--output-len", "10", "--max-concurrency", "3", "--goodput", "ttft:60000",
                  "tpot:60000", "--probe", "/health", "--save-result", str(out))
    assert code == 0
    assert "Successful requests:                             6" in stdout
    assert "Output token throughput (tok/s):" in stdout and "P99 ITL (ms):" in stdout
    m = json.loads(out.read_text())["result"]
    assert m["completed"] == 6 and m["failed"] == 0
    # Token-exact prompts: the server's own count (usage) agrees with the requested length.
    assert m["total_input_tokens"] == 6 * 24 and m["total_output_tokens"] == 6 * 10
    assert 0 < m["median_ttft_ms"] <= m["p99_ttft_ms"] <= m["p99_e2el_ms"]
    assert m["mean_ttft_ms"] <= m["mean_e2el_ms"] and m["mean_tpot_ms"] > 0
    assert m["good_requests"] == 6 and m["goodput"] == pytest.approx(m["request_throughput"])
    assert m["max_concurrency"] == 3 and m["p99_probe_ms"] > 0


def test_poisson_arrivals_chat_and_per_request_invariants(server, tiny_llama):
    tok = Tokenizer(tiny_llama)
    reqs = datasets.random_requests(5, 16, 6, tokenizer=tok, seed=2)
    cfg = serve.ServeConfig(base_url=server, endpoint="/v1/chat/completions", request_rate=20.0, seed=1)
    summary, results = asyncio.run(serve.benchmark(cfg, reqs, tokenizer=tok))
    assert cfg.model == "tiny"  # asked the server for its model
    assert summary["completed"] == 5
    starts = sorted(r.start_time for r in results)
    assert starts[-1] - starts[0] > 0.01  # spread out by the arrival process, not sent at once
    for r in results:
        assert r.success and r.output_tokens == 6
        assert 0 < r.ttft <= r.latency and len(r.itl) >= 1
        assert r.prompt_len > 16  # the chat template adds its tokens, as the server's usage reports


def test_failures_are_counted_not_raised(server):
    reqs = datasets.random_requests(2, 8, 4, vocab_size=300, as_text=False)
    cfg = serve.ServeConfig(base_url=server, model="no-such-model")
    summary, _ = asyncio.run(serve.benchmark(cfg, reqs, warmup=False))
    assert summary["completed"] == 0 and summary["failed"] == 2
    assert summary["errors"][0].startswith("HTTP 404")


def test_sweep_finds_max_concurrency_and_plots(server, tiny_llama, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out, plots = tmp_path / "sweep.json", tmp_path / "plots"
    code, stdout = _bench(capsys, "serve", "--base-url", server, "--tokenizer", str(tiny_llama), "--input-len", "16", "--output-len", "8",
                  "--sweep-concurrency", "1,2", "--goodput", "ttft:60000", "--save-result", str(out),
                  "--plot-dir", str(plots), "--label", "pagoda tiny")
    assert code == 0
    sweep = json.loads(out.read_text())["sweep"]
    assert [lv["max_concurrency"] for lv in sweep["levels"]] == [1, 2]
    assert [lv["completed"] for lv in sweep["levels"]] == [1, 2]  # one request per client by default
    assert sweep["max_concurrency_meeting_slo"] == 2
    assert "max concurrency meeting the SLOs: 2" in stdout
    for name in ("throughput_vs_concurrency.png", "latency_vs_concurrency.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, _ = _bench(capsys, "plot", str(out), str(out), "--labels", "a", "b", "--plot-dir", str(tmp_path / "both"))
    assert code == 0
    assert (tmp_path / "both" / "latency_vs_concurrency.png").exists()
