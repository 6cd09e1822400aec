"""Server cost per token: where `pagoda serve` spends its own time per generated token, apart from the model.

    python benchmarks/server_overhead.py                                   # micro, then 64 streams on tiny and SmolLM2
    python benchmarks/server_overhead.py --servers before=7d3abfa,after=.  # the same load on each tree's server, one run
    python benchmarks/server_overhead.py --servers "thread=.,process=. --engine-process" --models tiny
    python benchmarks/server_overhead.py --skip-e2e                        # microbenchmarks only

1. Microbenchmarks of the per-token work, with the objects the server really builds (best of 9
   repeats): JSON + SSE framing of a chunk (json.dumps, the old path, vs `serving.sse`), the
   engine → event loop hop (call_soon_threadsafe, a queue per request, the consumer's wake-up),
   incremental detokenization, OutputProcessor.process_outputs per step at batch 64, and the
   texts of one position's logprobs (tokenizer calls vs the OutputProcessor's cache).
2. End to end: `pagoda serve` under N concurrent streaming clients (`pagoda bench serve`'s client,
   /v1/completions, prompts of --input-len tokens, exactly --output-len tokens each), with py-spy
   sampling the server process. Each sample goes to one component by the frames on its stack
   (LOOP_COMPONENTS). CPU time per thread over the load comes from /proc; the event loop's user
   time is split among its components by their shares of py-spy's samples (taken with --gil, so
   a thread waiting for the GIL is not counted as working), its system time is the kernel's.
   Servers can be other git trees (`git archive`d into a temporary directory, served from
   there) or take other flags (ServerSpec); rounds alternate their order.

The tiny model (tests/tiny_models.py: 2 layers, hidden 64) makes the model nearly free, so the
server's own cost dominates; SmolLM2 shows the share that cost has in real serving.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import timeit
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))

# The event loop's components, by the frames on a sample's stack: the first component (in this
# order) with a frame that contains one of its markers takes the sample. py-spy names frames
# "function (path/file.py:line)"; orjson is C, so its time shows as `dumps (serving.py)` itself.
LOOP_COMPONENTS = [
    ("JSON serialization", ("(json/", "dumps (pagoda/entrypoints/openai/serving.py")),
    ("SSE framing", ("sse (pagoda/entrypoints/openai/serving.py",)),
    ("detokenization", ("pagoda/engine/detokenizer.py",)),
    ("output processor (rest)", ("pagoda/engine/output_processor.py",)),
    ("metrics", ("pagoda/entrypoints/prometheus.py", "prometheus_client/")),
    ("logging", ("(logging/",)),
    ("request setup", ("pagoda/engine/llm_engine.py", "pagoda/entrypoints/openai/protocol.py", "pydantic")),
    ("engine → loop hop, queues", ("pagoda/engine/async_llm.py", "asyncio/queues.py", "_read_from_self")),
    ("chunk building (serving.py)", ("pagoda/entrypoints/openai/serving.py",)),
    ("HTTP protocol (uvicorn, h11)", ("h11/", "uvicorn/protocols/", "_SelectorSocketTransport")),
    ("BaseHTTPMiddleware", ("starlette/middleware/base.py",)),
    ("ASGI framework (starlette, fastapi, anyio)", ("starlette/", "fastapi/", "anyio/", "sniffio/")),
    ("event loop (asyncio)", ("",)),
]
KERNEL = "kernel: socket send / recv, epoll"
LOOP_ROWS = [name for name, _ in LOOP_COMPONENTS] + [KERNEL]
ENGINE_THREAD = "engine thread (model step: Python and kernels)"
NATIVE_THREADS = "torch worker threads"
OTHER_THREADS = "other Python threads"
ENGINE_ROWS = [ENGINE_THREAD, NATIVE_THREADS]


# -- microbenchmarks ------------------------------------------------------------------------------

def per_call_us(*fns, repeat: int = 9) -> list[float]:
    """µs per call of each fn(): the best of `repeat` timings, the functions taking turns so that
    the machine's noise falls on all of them alike."""
    timers = [timeit.Timer(fn) for fn in fns]
    numbers = [timer.autorange()[0] for timer in timers]
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, (timer, number) in enumerate(zip(timers, numbers)):
            best[i] = min(best[i], timer.timeit(number) / number)
    return [b * 1e6 for b in best]


def _old_sse(data) -> bytes:
    """The server's SSE event before orjson: json.dumps into a str, which Starlette encodes."""
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def _chunks(tokenizer, k: int) -> dict[str, tuple[dict, int]]:
    """Realistic bodies built by serving.py's own code: name → (body, tokens it carries)."""
    from pagoda.engine.output_processor import OutputProcessor
    from pagoda.entrypoints.openai.serving import Serving
    from pagoda.worker.model_runner import TokenLogprobs

    serving = Serving.__new__(Serving)  # the logprob formatters need only the tokenizer
    serving.tokenizer = tokenizer
    ids = tokenizer.encode(" The quick brown fox jumps over the lazy dog, said the engine.", add_special_tokens=False)
    tid = ids[1]
    position = OutputProcessor(tokenizer)._position(TokenLogprobs([tid, *ids[:k]], [-0.7 - 0.1 * i for i in range(k + 1)], 1))
    text = tokenizer.decode([tid])
    head = {"id": "chatcmpl-1f0c6a9b2e4d4c3f8a7b6e5d", "object": "chat.completion.chunk", "created": 1764439200,
            "model": "smollm2-135m-instruct"}
    cmpl = {**head, "id": "cmpl-1f0c6a9b2e4d4c3f8a7b6e5d", "object": "text_completion"}
    choice = {"index": 0, "logprobs": None, "finish_reason": None, "stop_reason": None}
    chat_lp = serving._chat_logprobs([tid], [position], k)
    cmpl_lp = serving._completion_logprobs([tid], [position], k)
    n = 128  # a non-streamed chat body carrying n tokens with logprobs
    body = {**head, "object": "chat.completion", "choices": [{
        "index": 0, "message": {"role": "assistant", "content": text * n}, "finish_reason": "length", "stop_reason": None,
        "logprobs": serving._chat_logprobs([tid] * n, [position] * n, k)}],
        "usage": {"prompt_tokens": 128, "completion_tokens": n, "total_tokens": 128 + n}}
    return {
        "completion chunk": ({**cmpl, "choices": [{**choice, "text": text}]}, 1),
        "chat chunk": ({**head, "choices": [{**choice, "delta": {"content": text}}]}, 1),
        f"completion chunk, logprobs={k}": ({**cmpl, "choices": [{**choice, "text": text, "logprobs": cmpl_lp}]}, 1),
        f"chat chunk, top_logprobs={k}": ({**head, "choices": [{**choice, "delta": {"content": text},
                                                                "logprobs": chat_lp}]}, 1),
        f"chat body, {n} tokens, top_logprobs={k}": (body, n),
    }


def micro_serialization(tokenizer, k: int) -> list[dict]:
    from pagoda.entrypoints.openai.response_parts import dumps, sse

    rows = []
    for name, (obj, tokens) in _chunks(tokenizer, k).items():
        assert json.loads(_old_sse(obj)[6:]) == json.loads(sse(obj)[6:])
        old, new, new_json = per_call_us(*(lambda f=f, obj=obj: f(obj) for f in (_old_sse, sse, dumps)))
        rows.append({"body": name, "bytes": len(sse(obj)), "tokens": tokens, "json.dumps + framing_us": old,
                     "orjson + framing_us": new, "orjson alone_us": new_json, "speedup": old / new})
    return rows


def micro_hop(batch: int, steps: int = 200) -> float:
    """µs per token for the engine → loop hop as AsyncLLM does it: one call_soon_threadsafe per
    step from a thread, one put_nowait per request, each request's consumer task woken."""

    async def run() -> float:
        loop = asyncio.get_running_loop()
        queues = [asyncio.Queue() for _ in range(batch)]
        drained = threading.Event()
        left = [0]

        def deliver(items):
            for q, item in zip(queues, items):
                q.put_nowait(item)

        async def consume(q):
            while await q.get() is not None:
                left[0] -= 1
                if left[0] == 0:
                    drained.set()

        tasks = [asyncio.create_task(consume(q)) for q in queues]
        await asyncio.sleep(0)

        def engine():
            for step in range(steps):
                drained.clear()
                left[0] = batch
                loop.call_soon_threadsafe(deliver, [step] * batch)
                drained.wait()

        start = time.perf_counter()
        await asyncio.to_thread(engine)
        elapsed = time.perf_counter() - start
        loop.call_soon(deliver, [None] * batch)
        await asyncio.gather(*tasks)
        return elapsed / (steps * batch) * 1e6

    return min(asyncio.run(run()) for _ in range(9))


def _token_stream(tokenizer, n: int) -> list[int]:
    """n tokens of real English text (the perplexity text shipped in benchmarks/data)."""
    ids = tokenizer.encode((HERE / "data" / "perplexity.txt").read_text(), add_special_tokens=False)
    assert len(ids) >= n, f"the text has {len(ids)} tokens, fewer than {n}"
    return ids[:n]


def micro_detokenize(tokenizer, n: int = 512) -> float:
    from pagoda.engine.detokenizer import IncrementalDetokenizer

    ids = _token_stream(tokenizer, n)

    def run():
        d = IncrementalDetokenizer(tokenizer, ids[:5])
        for t in ids:
            d.step([t])

    return per_call_us(run)[0] / len(ids)


def micro_output_processor(tokenizer, batch: int, steps: int, logprobs: int | None) -> float:
    """µs per token of OutputProcessor.process_outputs, one token per request per step."""
    from pagoda.engine.core import EngineCoreOutput
    from pagoda.engine.output_processor import OutputProcessor
    from pagoda.sampling_params import RequestOutputKind, SamplingParams
    from pagoda.worker.model_runner import TokenLogprobs

    ids = _token_stream(tokenizer, steps + 128)
    params = SamplingParams(max_tokens=steps, logprobs=logprobs, output_kind=RequestOutputKind.DELTA)
    k = logprobs or 0
    best = float("inf")
    for _ in range(9):
        proc = OutputProcessor(tokenizer)
        for r in range(batch):
            proc.add_request(str(r), None, ids[:128], [(f"{r}-0", params)], 0.0)
        outputs = []
        for s in range(steps):
            tok = ids[128 + s]
            lp = [TokenLogprobs([tok, *ids[s:s + k]], [-0.5] * (k + 1), 1)] if logprobs is not None else None
            outputs.append([EngineCoreOutput(f"{r}-0", [tok], "length" if s == steps - 1 else None, new_logprobs=lp)
                            for r in range(batch)])
        start = time.perf_counter()
        for step in outputs:
            proc.process_outputs(step)
        best = min(best, time.perf_counter() - start)
    return best / (batch * steps) * 1e6


def micro_logprob_position(tokenizer, k: int) -> dict[str, float]:
    """µs to turn one position's k + 1 logprobs into Logprobs with their texts: each token decoded
    by the tokenizer (as before the cache; the cache emptied each time) vs found in the cache."""
    from pagoda.engine.output_processor import OutputProcessor
    from pagoda.worker.model_runner import TokenLogprobs

    proc = OutputProcessor(tokenizer)
    ids = _token_stream(tokenizer, k + 1)
    lp = TokenLogprobs(ids, [-0.5] * (k + 1), 1)

    def cold():
        proc._token_texts.clear()
        return proc._position(lp)

    decoded, cached = per_call_us(cold, lambda: proc._position(lp))
    return {"decoded_us": decoded, "cached_us": cached}


def run_micro(models: dict[str, str], batch: int, k: int) -> dict:
    from pagoda.bench.datasets import load_tokenizer

    out = {"hop_us_per_token": micro_hop(batch), "models": {}}
    print(f"\nengine → loop hop at batch {batch}: {out['hop_us_per_token']:.2f} µs per token", flush=True)
    for label, model in models.items():
        tok = load_tokenizer(model)
        rec = {
            "serialization": micro_serialization(tok, k),
            "detokenize_us_per_token": micro_detokenize(tok),
            "output_processor_us_per_token": micro_output_processor(tok, batch, 64, None),
            f"output_processor_logprobs{k}_us_per_token": micro_output_processor(tok, batch, 64, k),
            "logprob_position": {n: micro_logprob_position(tok, n) for n in (k, 20)},
        }
        out["models"][label] = rec
        print(f"\n{label}: per-chunk serialization (µs)\n")
        print("| body | bytes | json.dumps + framing | orjson + framing | of which orjson | speedup |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for r in rec["serialization"]:
            print(f"| {r['body']} | {r['bytes']:,} | {r['json.dumps + framing_us']:.2f} | {r['orjson + framing_us']:.2f} "
                  f"| {r['orjson alone_us']:.2f} | {r['speedup']:.1f}x |")
        print(f"\n{label}: detokenization {rec['detokenize_us_per_token']:.2f} µs/token; OutputProcessor at batch {batch}: "
              f"{rec['output_processor_us_per_token']:.2f} µs/token, with logprobs={k}: "
              f"{rec[f'output_processor_logprobs{k}_us_per_token']:.2f} µs/token", flush=True)
        for n, r in rec["logprob_position"].items():
            print(f"{label}: one position's {n + 1} logprobs: {r['decoded_us']:.2f} µs decoding each token, "
                  f"{r['cached_us']:.2f} µs from the cache", flush=True)
    return out


# -- end to end -----------------------------------------------------------------------------------

def classify(frames: list[str]) -> str:
    """The event-loop component of one sample's frames (root → leaf)."""
    for name, markers in LOOP_COMPONENTS:
        if any(m in frame for frame in frames for m in markers):
            return name
    return LOOP_COMPONENTS[-1][0]


def parse_profile(path: Path) -> tuple[dict[int, str], collections.Counter]:
    """py-spy's raw output (--threads --gil) → (thread id → name, the main thread's samples by component)."""
    names: dict[int, str] = {}
    loop: collections.Counter = collections.Counter()
    for line in path.read_text().splitlines() if path.exists() else []:
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        thread, *frames = stack.split(";")  # "thread (1234): name"
        tid = int(thread.split("(", 1)[1].split(")", 1)[0], 0)
        names[tid] = thread.split("): ", 1)[1]
        if names[tid] == "MainThread":
            loop[classify(frames)] += int(n)
    return names, loop


def thread_cpu_s(pid: int) -> dict[int, tuple[float, float]]:
    """(user, system) CPU seconds each thread of a process has used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            out[int(task.name)] = (int(fields[11]) / tick, int(fields[12]) / tick)
    return out


def us_per_token(cpu: dict[int, tuple[float, float]], names: dict[int, str], loop: collections.Counter,
                 tokens: int) -> dict[str, float]:
    """CPU µs per token by row. The event loop's user time is split among its components by
    their shares of the GIL-holding samples; its system time is the kernel's work for it."""
    us: collections.Counter = collections.Counter()
    per_token = 1e6 / tokens
    total = sum(loop.values())
    for tid, (user, system) in cpu.items():
        name = names.get(tid)
        if name == "MainThread":
            for component, n in loop.items():
                us[component] += user * n / total * per_token
            us[KERNEL] += system * per_token
        elif name is None:  # never seen holding the GIL: a native thread
            us[NATIVE_THREADS] += (user + system) * per_token
        else:
            us[ENGINE_THREAD if name.startswith("pagoda-engine") else OTHER_THREADS] += (user + system) * per_token
    return dict(us)


@dataclass
class ServerSpec:
    """One server to measure, from "name=REF[@SITE] [FLAGS...]": the git tree REF ("." is this
    working tree), SITE put on its PYTHONPATH (packages installed with pip install --target),
    FLAGS added to `pagoda serve`."""

    name: str
    ref: str
    site: str = ""
    flags: tuple[str, ...] = ()

    @classmethod
    def parse(cls, spec: str) -> ServerSpec:
        name, _, rest = spec.partition("=")
        where, *flags = rest.split()
        ref, _, site = where.partition("@")
        return cls(name, ref, site, tuple(flags))


@contextlib.contextmanager
def tree_dir(ref: str):
    """A directory holding the tree `ref` ("." is this working tree)."""
    if ref == ".":
        yield ROOT
        return
    with tempfile.TemporaryDirectory(prefix="pagoda-tree-") as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        yield Path(tmp)


def _server_pid(port: int) -> int:
    out = subprocess.run(["pgrep", "-f", "--", f"pagoda.cli serve .* --port {port} "],
                         capture_output=True, text=True, check=False).stdout.split()
    if len(out) != 1:
        raise RuntimeError(f"expected one server process on port {port}, found {out}")
    return int(out[0])


def run_e2e(spec: ServerSpec, tree: Path, model: str, ns: argparse.Namespace, profile_path: Path) -> dict:
    from pagoda.bench import datasets, serve, servers

    port = servers.free_port()
    env = [f"PYTHONPATH={spec.site}"] if spec.site else []
    cmd = ["env", "-C", str(tree), *env, *servers.pagoda_command(
        model, port, "--dtype", "float32", "--kv-cache-memory", str(ns.kv_cache_memory), *spec.flags)]
    tokenizer = datasets.load_tokenizer(model)
    requests = datasets.random_requests(ns.concurrency, ns.input_len, ns.output_len, tokenizer=tokenizer, seed=0)
    extra = {"logprobs": ns.logprobs} if ns.logprobs is not None else {}
    with servers.running(cmd, port) as base:
        cfg = serve.ServeConfig(base_url=base, model=model, extra_body=extra)
        asyncio.run(serve.benchmark(cfg, requests[:8]))  # warm-up: every step shape once, not measured
        pid = _server_pid(port)
        spy = None
        if not ns.no_profile:
            spy = subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--format", "raw", "--threads", "--gil",
                                    "--nonblocking", "--rate", str(ns.rate), "-o", str(profile_path)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # attached; the idle server adds no samples
        before, client_before = thread_cpu_s(pid), time.process_time()
        summary, results = asyncio.run(serve.benchmark(cfg, requests, warmup=False))
        after, client_cpu = thread_cpu_s(pid), time.process_time() - client_before
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=60)
    tokens = sum(r.output_tokens for r in results if r.success)
    cpu = {tid: (u - before.get(tid, (0.0, 0.0))[0], k - before.get(tid, (0.0, 0.0))[1]) for tid, (u, k) in after.items()}
    names, loop = parse_profile(profile_path)
    us = us_per_token(cpu, names, loop, tokens) if loop else {}
    held = collections.Counter()  # samples with the GIL held, by thread name
    for line in profile_path.read_text().splitlines() if profile_path.exists() else []:
        stack, _, n = line.rpartition(" ")
        held[stack.split(";", 1)[0].split("): ", 1)[-1]] += int(n)
    seconds = summary["duration_s"]
    return {"output_tokens": tokens, "failed": sum(not r.success for r in results),
            "duration_s": seconds, "output_tok_s": tokens / seconds, "loadavg_1m": summary.get("loadavg_1m"),
            "itl_ms": {q: summary[f"{q}_itl_ms"] for q in ("median", "p99")},
            "process_cpu_us_per_token": sum(u + k for u, k in cpu.values()) / tokens * 1e6,
            "client_cpu_us_per_token": client_cpu / tokens * 1e6,
            "gil_held_share": {name: n / ns.rate / seconds for name, n in held.items()},
            "thread_cpu_s": {f"{tid} {names.get(tid, '(native)')}": c for tid, c in cpu.items() if sum(c) > 0},
            "loop_samples": dict(loop), "us_per_token": us,
            "server_us_per_token": sum(us.get(c, 0.0) for c in LOOP_ROWS),
            "engine_us_per_token": sum(us.get(c, 0.0) for c in ENGINE_ROWS)}


def mean_records(records: list[dict]) -> dict:
    """The rounds of one (model, server) averaged: µs per token and throughput."""
    names = sorted({k for r in records for k in r["us_per_token"]})

    def avg(key: str) -> float:
        return sum(r[key] for r in records) / len(records)

    return {"rounds": len(records), "output_tok_s": avg("output_tok_s"), "output_tokens": records[0]["output_tokens"],
            "server_us_per_token": avg("server_us_per_token"), "engine_us_per_token": avg("engine_us_per_token"),
            "process_cpu_us_per_token": avg("process_cpu_us_per_token"), "client_cpu_us_per_token": avg("client_cpu_us_per_token"),
            "itl_ms": {q: sum(r["itl_ms"][q] for r in records) / len(records) for q in ("median", "p99")},
            "gil_held_share": {t: sum(r["gil_held_share"].get(t, 0.0) for r in records) / len(records)
                               for t in ("MainThread", "pagoda-engine")},
            "us_per_token": {n: sum(r["us_per_token"].get(n, 0.0) for r in records) / len(records) for n in names}}


def format_e2e(label: str, by_server: dict[str, dict]) -> str:
    names = list(by_server)
    lines = [f"\n{label}: µs of CPU per generated token (share of the event loop's)\n",
             "| component | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(names)]

    def row(title: str, cell) -> None:
        lines.append(f"| {title} | " + " | ".join(cell(by_server[n]) for n in names) + " |")

    for c in LOOP_ROWS:
        row(c, lambda m, c=c: f"{m['us_per_token'].get(c, 0.0):.1f} ({m['us_per_token'].get(c, 0.0) / (m['server_us_per_token'] or 1):.0%})")
    row("**event loop thread, total**", lambda m: f"**{m['server_us_per_token']:.0f}**")
    for c in ENGINE_ROWS + [OTHER_THREADS]:
        row(c, lambda m, c=c: f"{m['us_per_token'].get(c, 0.0):.0f}")
    row("server process CPU, total", lambda m: f"{m['process_cpu_us_per_token']:.0f}")
    row("load generator CPU (not the server)", lambda m: f"{m['client_cpu_us_per_token']:.0f}")
    row("GIL held by the event loop / engine thread", lambda m: "{:.0%} / {:.0%}".format(
        m["gil_held_share"].get("MainThread", 0.0), m["gil_held_share"].get("pagoda-engine", 0.0)))
    row("ITL p50 / p99 (ms)", lambda m: f"{m['itl_ms']['median']:.0f} / {m['itl_ms']['p99']:.0f}")
    row("output tok/s", lambda m: f"{m['output_tok_s']:.0f}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,smollm2-135m-instruct",
                    help="comma-separated; 'tiny' is the random 2-layer Llama of tests/tiny_models.py")
    ap.add_argument("--servers", default="now=.", help="comma-separated name=REF[@SITE] [FLAGS...] (see ServerSpec); "
                    "'.' is the working tree")
    ap.add_argument("--rounds", type=int, default=1, help="end-to-end runs per (model, server), in alternating order")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--logprobs", type=int, default=None, help="ask every request for this many logprobs")
    ap.add_argument("--kv-cache-memory", type=float, default=2.0)
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument("--top-logprobs", type=int, default=5, help="k of the logprob bodies in the microbenchmarks")
    ap.add_argument("--skip-micro", action="store_true")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--no-profile", action="store_true", help="end to end without py-spy (throughput only)")
    ap.add_argument("--save", default=None, help="JSON path (default: benchmarks/results/server-overhead-<date>.json)")
    ns = ap.parse_args()
    if not ns.skip_e2e and not ns.no_profile and shutil.which("py-spy") is None:
        ap.error("the end-to-end profile needs py-spy (pip install py-spy), or pass --no-profile")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    work = Path(tempfile.mkdtemp(prefix="pagoda-overhead-"))
    models = {}
    for name in (m.strip() for m in ns.models.split(",") if m.strip()):
        if name == "tiny":
            from tiny_models import make_tiny_hf_model

            models[name] = str(make_tiny_hf_model("llama", work / "tiny", seed=0))
        else:
            models[name] = name
    specs = [ServerSpec.parse(item) for item in ns.servers.split(",")]
    record: dict = {"date": date.today().isoformat(), "command": " ".join(sys.argv), "args": vars(ns), "head": _head(),
                    "servers": {spec.name: asdict(spec) for spec in specs}}
    if not ns.skip_micro:
        record["micro"] = run_micro(models, ns.concurrency, ns.top_logprobs)
    if not ns.skip_e2e:
        record["e2e"] = {}
        with contextlib.ExitStack() as stack:
            trees = {ref: stack.enter_context(tree_dir(ref)) for ref in {spec.ref for spec in specs}}
            for label, model in models.items():
                runs: dict[str, list[dict]] = {spec.name: [] for spec in specs}
                for r in range(ns.rounds):
                    for spec in (specs if r % 2 == 0 else specs[::-1]):
                        print(f"{label} / {spec.name}: round {r + 1}", file=sys.stderr, flush=True)
                        profile = work / f"{label}-{spec.name}-{r}.txt"
                        runs[spec.name].append(run_e2e(spec, trees[spec.ref], model, ns, profile))
                by_server = {name: mean_records(rs) for name, rs in runs.items()}
                record["e2e"][label] = {"runs": runs, "mean": by_server}
                print(format_e2e(f"{label}, {ns.concurrency} streams x {ns.output_len} tokens", by_server), flush=True)
    save = Path(ns.save) if ns.save else HERE / "results" / f"server-overhead-{date.today().isoformat()}.json"
    save.parent.mkdir(parents=True, exist_ok=True)
    save.write_text(json.dumps(record, indent=2, default=str))
    print(f"saved {save}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


def _head() -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
