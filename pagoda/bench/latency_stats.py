"""Per-request measurements and what they add up to: throughput, latency percentiles, goodput.

Definitions (as in vLLM's benchmarks):

- TTFT: time from sending the request to the first streamed token.
- TPOT: per request, (end-to-end latency - TTFT) / (output tokens - 1); requests with one output
  token have none.
- ITL: every gap between two consecutive streamed chunks, over all requests.
- E2EL: time from sending the request to its last chunk.
- Goodput: completed requests per second that met every SLO given (``ttft``, ``tpot``, ``e2el``,
  in milliseconds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


@dataclass
class RequestResult:
    """What one request measured. Times are in seconds."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start_time: float = 0.0
    generated_text: str = ""
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def percentile(values, q: float) -> float:
    """The q-th percentile with linear interpolation (numpy's default); nan for no values."""
    if len(values) == 0:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def parse_slos(items: list[str] | None) -> dict[str, float]:
    """``["ttft:5000", "tpot:500"]`` → ``{"ttft": 5000.0, "tpot": 500.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput takes NAME:MILLISECONDS with NAME in {', '.join(SLO_METRICS)}, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if ms <= 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be > 0 ms")
        slos[name] = ms
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    if not r.success:
        return False
    measured = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency}
    for name, limit_ms in slos.items():
        value = measured[name]
        if value is not None and value * 1e3 > limit_ms:
            return False
    return True


def _describe(prefix: str, values_s: list[float], percentiles) -> dict[str, float]:
    ms = [v * 1e3 for v in values_s]
    out = {f"mean_{prefix}_ms": float(np.mean(ms)) if ms else math.nan,
           f"median_{prefix}_ms": percentile(ms, 50),
           f"std_{prefix}_ms": float(np.std(ms)) if ms else math.nan}
    for p in percentiles:
        out[f"p{p:g}_{prefix}_ms"] = percentile(ms, p)
    return out


def summarize(results: list[RequestResult], duration_s: float, slos: dict[str, float] | None = None,
              percentiles=DEFAULT_PERCENTILES) -> dict:
    """The benchmark's numbers from its requests and its wall time (the keys of the JSON result)."""
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    duration_s = max(duration_s, 1e-9)
    out = {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "input_throughput": input_tokens / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
    }
    out.update(_describe("ttft", [r.ttft for r in ok], percentiles))
    out.update(_describe("tpot", [r.tpot for r in ok if r.tpot is not None], percentiles))
    out.update(_describe("itl", [x for r in ok for x in r.itl], percentiles))
    out.update(_describe("e2el", [r.latency for r in ok], percentiles))
    if slos:
        good = sum(meets_slos(r, slos) for r in results)
        out["slos_ms"] = dict(slos)
        out["good_requests"] = good
        out["goodput"] = good / duration_s
        out["slo_attainment"] = good / len(results) if results else math.nan
    errors = sorted({r.error for r in results if not r.success and r.error})
    if errors:
        out["errors"] = errors[:10]
    return out


def format_summary(m: dict, title: str) -> str:
    """vLLM-style block of lines for a terminal."""
    w = 50
    lines = [f"{' ' + title + ' ':=^{w}}",
             f"{'Successful requests:':<40}{m['completed']:>10}",
             f"{'Failed requests:':<40}{m['failed']:>10}",
             f"{'Benchmark duration (s):':<40}{m['duration_s']:>10.2f}",
             f"{'Total input tokens:':<40}{m['total_input_tokens']:>10}",
             f"{'Total generated tokens:':<40}{m['total_output_tokens']:>10}",
             f"{'Request throughput (req/s):':<40}{m['request_throughput']:>10.2f}",
             f"{'Output token throughput (tok/s):':<40}{m['output_throughput']:>10.2f}",
             f"{'Total token throughput (tok/s):':<40}{m['total_token_throughput']:>10.2f}"]
    if "goodput" in m:
        slos = " ".join(f"{k}:{v:g}" for k, v in m["slos_ms"].items())
        lines.append(f"{'Goodput (req/s) [' + slos + ']:':<40}{m['goodput']:>10.2f}")
    for key, name in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                      ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{' ' + name + ' ':-^{w}}")
        lines.append(f"{'Mean ' + key.upper() + ' (ms):':<40}{m[f'mean_{key}_ms']:>10.2f}")
        lines.append(f"{'Median ' + key.upper() + ' (ms):':<40}{m[f'median_{key}_ms']:>10.2f}")
        for k, v in m.items():
            if k.startswith("p") and k.endswith(f"_{key}_ms") and k != f"p50_{key}_ms":
                lines.append(f"{k.split('_')[0].upper() + ' ' + key.upper() + ' (ms):':<40}{v:>10.2f}")
    if m.get("spec_decode"):
        lines += format_spec(m["spec_decode"])
    for e in m.get("errors", []):
        lines.append(f"error: {e}")
    lines.append("=" * w)
    return "\n".join(lines)


# -- speculative decoding ------------------------------------------------------------------------
SPEC_COUNTERS = ("num_drafts", "draft_tokens", "accepted_tokens", "draft_seconds", "verify_seconds")


def spec_from_stats(stats: dict) -> dict:
    """The speculative-decoding counters of ``LLMEngine.stats()``, named as ``spec_summary`` takes them."""
    return {"num_drafts": stats["spec_num_drafts"], "draft_tokens": stats["spec_draft_tokens"],
            "accepted_tokens": stats["spec_accepted_tokens"], "draft_seconds": stats["spec_draft_seconds"],
            "verify_seconds": stats["spec_verify_seconds"], "draft_tokens_per_pos": stats["spec_draft_tokens_per_pos"],
            "accepted_tokens_per_pos": stats["spec_accepted_tokens_per_pos"]}


def spec_summary(before: dict, after: dict) -> dict | None:
    """What speculative decoding did between two readings of its counters (``spec_from_stats`` or a
    server's /metrics): acceptance rate, mean accepted length (tokens per verification, the
    target's own included), acceptance per draft position, draft and verify seconds. None when
    nothing was verified."""
    delta = {k: after[k] - before.get(k, 0) for k in SPEC_COUNTERS}
    if not delta["num_drafts"]:
        return None

    def per_pos(key: str) -> list[float]:
        old = before.get(key, [])
        return [v - (old[i] if i < len(old) else 0) for i, v in enumerate(after[key])]

    drafted, accepted = per_pos("draft_tokens_per_pos"), per_pos("accepted_tokens_per_pos")
    return {**delta, "acceptance_rate": delta["accepted_tokens"] / delta["draft_tokens"],
            "mean_accepted_length": 1 + delta["accepted_tokens"] / delta["num_drafts"],
            "acceptance_per_position": [a / d if d else 0.0 for a, d in zip(accepted, drafted)]}


def format_spec(s: dict) -> list[str]:
    w = 50
    per_pos = ", ".join(f"{a:.2f}" for a in s["acceptance_per_position"])
    return [f"{' Speculative Decoding ':-^{w}}",
            f"{'Acceptance rate:':<40}{s['acceptance_rate']:>10.3f}",
            f"{'Mean accepted length:':<40}{s['mean_accepted_length']:>10.2f}",
            f"{'Verifications:':<40}{s['num_drafts']:>10.0f}",
            f"{'Drafts / accepted:':<30}{s['draft_tokens']:>10.0f}{s['accepted_tokens']:>10.0f}",
            f"Acceptance per position: {per_pos}",
            f"{'Draft / verify time (s):':<30}{s['draft_seconds']:>10.2f}{s['verify_seconds']:>10.2f}"]
