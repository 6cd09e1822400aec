"""Percentiles, TPOT and goodput on numbers worked out by hand."""

from __future__ import annotations

import math

import pytest

from pagoda.bench.latency_stats import RequestResult, format_summary, meets_slos, parse_slos, percentile, summarize


def test_percentile_interpolates_linearly():
    values = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 90) == pytest.approx(9.1)  # rank 0.9 * 9 = 8.1 → 9 + 0.1 * (10 - 9)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile(values, 100) == 10.0
    assert percentile([3.0], 99) == 3.0
    assert math.isnan(percentile([], 50))


def _result(ttft: float, latency: float, tokens: int, prompt: int = 10) -> RequestResult:
    gaps = [(latency - ttft) / (tokens - 1)] * (tokens - 1) if tokens > 1 else []
    return RequestResult(success=True, prompt_len=prompt, output_tokens=tokens, ttft=ttft, latency=latency, itl=gaps)


def test_tpot_excludes_the_first_token():
    assert _result(0.5, 2.5, 5).tpot == pytest.approx(0.5)  # (2.5 - 0.5) / 4
    assert _result(0.5, 0.5, 1).tpot is None


def test_summary_throughput_latency_and_goodput():
    results = [
        _result(ttft=0.1, latency=1.1, tokens=11),  # TPOT 100 ms
        _result(ttft=0.2, latency=2.2, tokens=11),  # TPOT 200 ms
        _result(ttft=3.0, latency=4.0, tokens=11),  # TTFT over the SLO
        RequestResult(success=False, prompt_len=10, error="HTTP 500: boom"),
    ]
    m = summarize(results, duration_s=4.0, slos=parse_slos(["ttft:1000", "tpot:150"]))
    assert (m["completed"], m["failed"]) == (3, 1)
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 33
    assert m["request_throughput"] == pytest.approx(0.75)
    assert m["output_throughput"] == pytest.approx(33 / 4)
    assert m["total_token_throughput"] == pytest.approx(63 / 4)
    assert m["mean_ttft_ms"] == pytest.approx(1100)
    assert m["median_ttft_ms"] == pytest.approx(200)
    assert m["p99_ttft_ms"] == pytest.approx(200 + 0.98 * 2800)
    assert m["mean_tpot_ms"] == pytest.approx(400 / 3)
    assert m["median_e2el_ms"] == pytest.approx(2200)
    assert m["mean_itl_ms"] == pytest.approx(400 / 3)  # 10 gaps of 100, 200 and 100 ms
    # Only the first request meets both SLOs: the second is too slow per token, the third to start,
    # the failed one never counts.
    assert m["good_requests"] == 1 and m["goodput"] == pytest.approx(0.25)
    assert m["slo_attainment"] == pytest.approx(0.25)
    assert m["errors"] == ["HTTP 500: boom"]
    text = format_summary(m, "test")
    assert "Goodput (req/s) [ttft:1000 tpot:150]:" in text and "P99 TTFT (ms):" in text


def test_slo_parsing_and_checks():
    assert parse_slos(["ttft:5000", "TPOT:500", "e2el:1e4"]) == {"ttft": 5000.0, "tpot": 500.0, "e2el": 10000.0}
    assert parse_slos(None) == {}
    for bad in (["ttft"], ["itl:5"], ["ttft:fast"], ["ttft:0"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_slos(bad)
    one_token = _result(ttft=0.3, latency=0.3, tokens=1)
    assert meets_slos(one_token, {"ttft": 500, "tpot": 1})  # no TPOT to violate
    assert not meets_slos(one_token, {"e2el": 200})
