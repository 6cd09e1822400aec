"""The content filter's cost: a 10,000-term list (Chinese and English) against none, at 64 streams.

    python benchmarks/moderation_overhead.py      # writes results/moderation-overhead-<date>.json

Two `pagoda serve` of SmolLM2-135M-Instruct (`--quantization gguf`, --max-num-seqs 64), the same
but for `--moderation-words` (the synthetic list) with `--moderation-action mask` (so every stream
generates its full length whatever it meets; the scan is the same work as under `stop`). Both are
up at once and are driven in turn, `--repeats` times each: 64 SSE streams of 64 tokens (greedy,
ignore_eos). Measured per run: tokens/s, the server process's CPU seconds per token (utime +
stime from /proc, engine thread included) and the mean time to the first text.

The list: 5,000 English terms (pseudo-words of 4-11 letters, a tenth of them two-word phrases;
some are real words, such as "some" or "like", and mask the output here and there) and 5,000
Chinese terms (2-4 common characters), random but fixed (seed 0), less the few that hit a prompt. The end-to-end
difference is within the noise of a shared 2-core machine, so the filter is also timed on its
own: the token texts the server streamed, fed one token at a time through an OutputGuard of the
same list (the work the output processor adds per token), and the prompt check.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import tempfile
import time
from datetime import date
from pathlib import Path

import httpx

HERE = Path(__file__).parent
MODEL = "smollm2-135m-instruct"
PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how rain forms, step by step.",
           "List some tips for learning a new language.", "Describe a busy market in the morning."]


def synthetic_terms(count: int = 10_000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"

    def word() -> str:
        n = rng.randint(2, 5)
        return "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(n))[: rng.randint(4, 11)]

    english = set()
    while len(english) < count // 2:
        english.add(f"{word()} {word()}" if rng.random() < 0.1 else word())
    chinese = set()
    while len(chinese) < count - count // 2:
        chinese.add("".join(chr(rng.randint(0x4E00, 0x62FF)) for _ in range(rng.randint(2, 4))))
    return sorted(english) + sorted(chinese)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _drive(base: str, streams: int, tokens: int) -> dict:
    """`streams` SSE completions at once; their token texts, and the mean time to first text."""
    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def one(i: int) -> tuple[list[str], float, int]:
            body = {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            pieces, first, generated = [], None, 0
            start = time.perf_counter()
            async with client.stream("POST", f"{base}/v1/completions", json=body) as answer:
                if answer.status_code != 200:
                    raise RuntimeError(f"{base} answered {answer.status_code}: {(await answer.aread()).decode()}")
                async for line in answer.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        generated = chunk["usage"]["completion_tokens"]
                    for c in chunk["choices"]:
                        if c["text"]:
                            first = first or time.perf_counter() - start
                            pieces.append(c["text"])
            return pieces, first or 0.0, generated

        results = await asyncio.gather(*(one(i) for i in range(streams)))
    return {"pieces": [p for r in results for p in r[0]], "ttft_s": sum(r[1] for r in results) / len(results),
            "tokens": sum(r[2] for r in results)}


def _micro(terms_file: str, pieces: list[str]) -> dict:
    """The filter alone: the streamed token texts through one guard per stream-sized run."""
    from pagoda.engine.content_filter import WordFilter

    t = time.perf_counter()
    word_filter = WordFilter.from_files([terms_file])
    build = time.perf_counter() - t
    rounds = 5
    t = time.perf_counter()
    for _ in range(rounds):
        guard = word_filter.guard("mask")
        for piece in pieces:
            guard.feed(piece)
        guard.feed("", final=True)
    per_token = (time.perf_counter() - t) / (rounds * len(pieces))
    checks = {}
    rng = random.Random(1)
    for name, text in [("english", "".join(pieces)[:4000]),
                       ("chinese", "".join(chr(rng.randint(0x4E00, 0x9FA5)) for _ in range(4000)))]:
        t = time.perf_counter()
        for _ in range(20):
            word_filter.first_list(text)
        checks[name] = 1e6 * (time.perf_counter() - t) / 20 / len(text) * 1000
    return {"build_s": build, "terms": word_filter.num_terms, "longest_term_chars": word_filter.max_len,
            "guard_us_per_token": 1e6 * per_token, "prompt_check_us_per_1k_chars": checks}


def main() -> None:
    from pagoda.bench.servers import free_port, pagoda_command
    from pagoda.loader import catalog
    from pagoda.platform import benchmark_cpu_flags, cpu_model

    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--terms", type=int, default=10_000)
    ns = parser.parse_args()
    model = str(catalog.pull(MODEL, quiet=True))  # cached: never downloads twice
    work = Path(tempfile.mkdtemp(prefix="moderation-bench-"))
    terms_file = work / "synthetic.txt"
    terms = synthetic_terms(ns.terms)
    from pagoda.engine.content_filter import WordFilter

    probe = WordFilter({"probe": terms})  # pseudo-words can be English words: keep the prompts clean
    in_prompts = {h.term for p in PROMPTS for h in probe.scan(p)}
    terms = [t for t in terms if t not in in_prompts]
    terms_file.write_text("\n".join(terms) + "\n", encoding="utf-8")
    common = ["--quantization", "gguf", "--max-num-seqs", str(ns.streams), "--served-model-name", MODEL]
    configs = {"none": [], "10k-list": ["--moderation-words", str(terms_file), "--moderation-action", "mask"]}
    procs, bases = {}, {}
    try:
        for name, extra in configs.items():
            port = free_port()
            procs[name] = subprocess.Popen(pagoda_command(model, port, *common, *extra))
            bases[name] = f"http://127.0.0.1:{port}"
        for name, base in bases.items():
            while True:
                if procs[name].poll() is not None:
                    raise RuntimeError(f"server {name} exited")
                try:
                    if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.5)
            asyncio.run(_drive(base, 4, 8))  # warm-up
        runs, pieces = [], []
        for repeat in range(ns.repeats):
            for name in list(configs)[:: 1 if repeat % 2 == 0 else -1]:  # the order alternates
                pid = procs[name].pid
                cpu, start = _cpu_seconds(pid), time.perf_counter()
                got = asyncio.run(_drive(bases[name], ns.streams, ns.tokens))
                wall, cpu = time.perf_counter() - start, _cpu_seconds(pid) - cpu
                pieces = pieces or got["pieces"]
                runs.append({"config": name, "tokens": got["tokens"], "wall_s": wall,
                             "tokens_per_s": got["tokens"] / wall, "server_cpu_ms_per_token": 1000 * cpu / got["tokens"],
                             "mean_ttft_s": got["ttft_s"]})
                r = runs[-1]
                print(f"{name:>9}: {r['tokens_per_s']:.1f} tok/s, server CPU {r['server_cpu_ms_per_token']:.3f} ms/token, "
                      f"TTFT {r['mean_ttft_s']:.2f} s, {r['wall_s']:.1f} s", flush=True)
        hits = sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{bases['10k-list']}/metrics").text.splitlines()
                   if line.startswith("pagoda:content_filter_hits_total{"))
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(timeout=60)
    micro = _micro(str(terms_file), pieces)
    checks = ", ".join(f"{k} {v:.0f}" for k, v in micro["prompt_check_us_per_1k_chars"].items())
    print(f"filter alone: {micro['guard_us_per_token']:.1f} us/token (longest term {micro['longest_term_chars']} "
          f"chars held back), prompt check (us per 1k chars) {checks}, list built in {micro['build_s']:.2f} s",
          flush=True)
    summary = {}
    for name in configs:
        mine = [r for r in runs if r["config"] == name]
        summary[name] = {k: sum(r[k] for r in mine) / len(mine)
                         for k in ("tokens_per_s", "server_cpu_ms_per_token", "mean_ttft_s")}
    out = HERE / "results" / f"moderation-overhead-{date.today()}.json"
    out.write_text(json.dumps({
        "date": str(date.today()), "model": MODEL, "quantization": "gguf", "streams": ns.streams, "tokens": ns.tokens,
        "terms": len(terms), "action": "mask", "cpu": cpu_model(), "cpu_flags": benchmark_cpu_flags(),
        "cores": os.cpu_count(), "load_average_after": os.getloadavg(), "output_terms_masked": hits,
        "runs": runs, "mean": summary, "filter_alone": micro}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
