"""`pagoda bench serve`: a load generator for any OpenAI-compatible server.

Each request streams a completion (``/v1/completions``) or a chat completion
(``/v1/chat/completions``) over SSE. Requests are sent all at once (``--request-rate inf``, the
default) or with Poisson arrivals at a given rate, and at most ``--max-concurrency`` are in flight.
Every request asks for exactly its output length (``ignore_eos``, which pagoda, vLLM and llama.cpp's
server accept; ``--extra-body`` adds other fields, such as a ``logit_bias`` for a server that lacks
it). The stream's chunks are timed: the first gives TTFT, the gaps give ITL. Token counts come from
the server's usage (``stream_options.include_usage``) where it reports one, else from the
tokenizer, else from the number of chunks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
from pathlib import Path
import random
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

from pagoda.bench import datasets
from pagoda.bench.latency_stats import (DEFAULT_PERCENTILES, RequestResult, percentile,
                                       spec_summary, summarize)
from pagoda.bench.servers import scrape_spec_decode

if TYPE_CHECKING:
    import aiohttp


def _aiohttp():
    """aiohttp, imported on use (it is one of pagoda's dependencies; `pagoda --help` need not load it).

    The load generator shares the machine with the server it measures, so its own CPU counts:
    httpx's streaming (h11, a pure-Python HTTP parser, under anyio) costs several times the CPU a
    chunk of aiohttp's (a C parser) (benchmarks/README.md, "The load generator's own cost")."""
    try:
        import aiohttp  # optional: aiohttp may be absent
    except ImportError:
        raise RuntimeError("pagoda bench serve needs aiohttp: pip install aiohttp") from None
    return aiohttp


@dataclass
class ServeConfig:
    base_url: str
    model: str | None = None  # the "model" field of each request; None: the server's first model
    endpoint: str = "/v1/completions"
    max_concurrency: int | None = None
    request_rate: float = math.inf  # requests/s, Poisson arrivals; inf: all at once
    temperature: float = 0.0
    ignore_eos: bool = True
    api_key: str | None = None
    extra_body: dict = field(default_factory=dict)
    timeout_s: float = 6 * 3600
    probe_path: str | None = None  # e.g. "/health": probed every 100 ms during the run
    seed: int = 0

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")


def _payload(cfg: ServeConfig, req: datasets.SampleRequest) -> dict:
    body: dict = {"model": cfg.model, "max_tokens": req.output_len, "temperature": cfg.temperature,
                  "stream": True, "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.chat:
        prompt = req.prompt if isinstance(req.prompt, str) else None
        if prompt is None:
            raise ValueError("the chat endpoint needs text prompts (token-id prompts only work with completions)")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = req.prompt
    body.update(cfg.extra_body)
    return body


def _chunk_text(chunk: dict, chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if chat:
        delta = choices[0].get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choices[0].get("text") or ""


async def send_request(client: aiohttp.ClientSession, cfg: ServeConfig, req: datasets.SampleRequest,
                       tokenizer=None) -> RequestResult:
    """One streamed request, timed chunk by chunk."""
    aiohttp = _aiohttp()
    result = RequestResult(prompt_len=req.prompt_len)
    body = _payload(cfg, req)
    stamps: list[float] = []
    parts: list[str] = []
    usage: dict | None = None
    result.start_time = start = time.perf_counter()
    try:
        async with client.post(cfg.base_url + cfg.endpoint, json=body) as r:
            if r.status != 200:
                result.error = f"HTTP {r.status}: {(await r.read()).decode(errors='replace')[:300]}"
                return result
            async for line in r.content:  # SSE lines, as bytes
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])[:300]
                    return result
                if chunk.get("usage"):
                    usage = chunk["usage"]
                text = _chunk_text(chunk, cfg.chat)
                if text:
                    stamps.append(time.perf_counter())
                    parts.append(text)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"[:300]
        return result
    if not stamps:
        result.error = "the stream carried no text"
        return result
    result.success = True
    result.ttft = stamps[0] - start
    result.latency = stamps[-1] - start
    result.itl = [b - a for a, b in zip(stamps, stamps[1:])]
    result.generated_text = "".join(parts)
    if usage and usage.get("completion_tokens"):
        result.output_tokens = int(usage["completion_tokens"])
        result.prompt_len = int(usage.get("prompt_tokens") or req.prompt_len)
    elif tokenizer is not None:
        result.output_tokens = len(tokenizer.encode(result.generated_text, add_special_tokens=False))
    else:
        result.output_tokens = len(stamps)
    return result


async def _arrivals(n: int, rate: float, rng: random.Random):
    """Yield 0..n-1, spaced by exponential gaps of mean 1/rate (Poisson arrivals); inf: no waiting."""
    for i in range(n):
        yield i
        if math.isfinite(rate) and i < n - 1:
            await asyncio.sleep(rng.expovariate(rate))


async def _probe(client: aiohttp.ClientSession, url: str, done: asyncio.Event, out: list[float]) -> None:
    aiohttp = _aiohttp()
    while not done.is_set():
        t0 = time.perf_counter()
        try:
            async with client.get(url) as r:
                await r.read()
            out.append(time.perf_counter() - t0)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        await asyncio.sleep(0.1)


def _client(cfg: ServeConfig, concurrency: int) -> aiohttp.ClientSession:
    aiohttp = _aiohttp()
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    conns = max(16, concurrency + 8)  # the load, a probe and some slack
    # read_bufsize bounds one SSE line (a chunk with many logprobs can pass aiohttp's default 64 KiB)
    return aiohttp.ClientSession(headers=headers, read_bufsize=1 << 22,
                                 timeout=aiohttp.ClientTimeout(total=cfg.timeout_s),
                                 connector=aiohttp.TCPConnector(limit=conns))


async def resolve_model_name(cfg: ServeConfig) -> str:
    async with _client(cfg, 1) as client, client.get(cfg.base_url + "/v1/models") as r:
        r.raise_for_status()
        return (await r.json())["data"][0]["id"]


async def benchmark(cfg: ServeConfig, requests: list[datasets.SampleRequest], *, tokenizer=None,
                    slos: dict[str, float] | None = None, percentiles=DEFAULT_PERCENTILES,
                    warmup: bool = True) -> tuple[dict, list[RequestResult]]:
    """Run the load; returns (summary, per-request results)."""
    if cfg.model is None:
        cfg.model = await resolve_model_name(cfg)
    spec_before = await asyncio.to_thread(scrape_spec_decode, cfg.base_url)
    async with _client(cfg, cfg.max_concurrency or len(requests)) as client:
        if warmup:  # a short request of its own (sharing no prefix with the load), not measured
            w = await send_request(client, cfg, datasets.SampleRequest("Hello, warm-up.", 4, 4), tokenizer)
            if not w.success:
                raise RuntimeError(f"the warm-up request to {cfg.base_url}{cfg.endpoint} failed: {w.error}")
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None

        async def limited(req: datasets.SampleRequest) -> RequestResult:
            if sem is None:
                return await send_request(client, cfg, req, tokenizer)
            async with sem:
                return await send_request(client, cfg, req, tokenizer)

        probes: list[float] = []
        done = asyncio.Event()
        prober = asyncio.create_task(_probe(client, cfg.base_url + cfg.probe_path, done, probes)) \
            if cfg.probe_path else None
        rng = random.Random(cfg.seed)
        start = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(requests), cfg.request_rate, rng):
            tasks.append(asyncio.create_task(limited(requests[i])))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        done.set()
        if prober is not None:
            await prober
    summary = summarize(results, duration, slos, percentiles)
    if spec_before is not None:
        spec_after = await asyncio.to_thread(scrape_spec_decode, cfg.base_url)
        summary["spec_decode"] = spec_summary(spec_before, spec_after) if spec_after else None
    summary.update({"max_concurrency": cfg.max_concurrency, "num_prompts": len(requests), "loadavg_1m": loadavg(),
                    "request_rate": cfg.request_rate if math.isfinite(cfg.request_rate) else "inf"})
    if cfg.probe_path:
        summary["probe_path"] = cfg.probe_path
        summary.update({f"p{q:g}_probe_ms": percentile([v * 1e3 for v in probes], q) for q in (50, 99)})
    return summary, list(results)


# -- command line ---------------------------------------------------------------------------------

def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None,
                   help="model name sent with each request (default: the server's first model); also the tokenizer's "
                        "source when it names a local model (directory, .gguf or catalog name)")
    p.add_argument("--tokenizer", default=None,
                   help="pagoda model whose tokenizer makes token-exact prompts and counts tokens (default: --model)")
    p.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    p.add_argument("--prompt-format", choices=["text", "ids"], default="text",
                   help="synthetic prompts as text (any server) or token ids (pagoda, vLLM)")
    datasets.add_cli_args(p, num_prompts_help="requests to send (default: 64; in a sweep, one per client)")
    g = p.add_argument_group("load")
    g.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no limit)")
    g.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (default inf: all at once)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (outputs may then be shorter than --output-len)")
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    g.add_argument("--api-key", default=None)
    g.add_argument("--no-warmup", dest="warmup", action="store_false")
    g.add_argument("--probe", default=None, metavar="PATH", help="also time GET PATH (e.g. /health) every 100 ms during the load")
    g = p.add_argument_group("report")
    g.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:5000 tpot:500 (names: ttft, tpot, e2el)")
    g.add_argument("--percentiles", default="50,90,99", help="latency percentiles to report")
    g.add_argument("--save-result", default=None, metavar="FILE.json")
    g.add_argument("--label", default=None, help="name of this system in results and plots (default: the base URL)")
    g = p.add_argument_group("sweep")
    g.add_argument("--sweep-concurrency", default=None, metavar="1,4,16,64",
                   help="run each concurrency in turn and find the largest that meets the SLOs")
    g.add_argument("--slo-attainment", type=float, default=0.99,
                   help="share of a level's requests that must meet every SLO for the level to pass (default 0.99)")
    g.add_argument("--plot-dir", default=None, help="write PNG plots of the sweep here (needs matplotlib)")


def config_from_args(ns: argparse.Namespace) -> ServeConfig:
    extra = json.loads(ns.extra_body) if ns.extra_body else {}
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    return ServeConfig(base_url=ns.base_url.rstrip("/"), model=ns.model, endpoint=ns.endpoint,
                       max_concurrency=ns.max_concurrency, request_rate=ns.request_rate, temperature=ns.temperature,
                       ignore_eos=ns.ignore_eos, api_key=ns.api_key, extra_body=extra, probe_path=ns.probe, seed=ns.seed)


def parse_percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--percentiles takes numbers like 50,90,99, got {text!r}") from None
    if not values or not all(0 < v <= 100 for v in values):
        raise ValueError(f"--percentiles must be in (0, 100], got {text!r}")
    return values


def loadavg() -> float | None:
    """The 1-minute load average at the end of a measurement: on a shared machine, how busy it was."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def environment(ns: argparse.Namespace) -> dict:
    return {"date": datetime.now().isoformat(timespec="seconds"), "command": " ".join(sys.argv),
            "args": {k: str(v) if isinstance(v, float) and not math.isfinite(v) else v
                     for k, v in vars(ns).items() if not callable(v)}}


def save_json(path: str, record: dict) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2, default=str))
    print(f"saved {out}")
