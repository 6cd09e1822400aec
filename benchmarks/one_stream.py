"""One stream through every path, side by side: where a served stream's time goes (issue 13).

    python benchmarks/one_stream.py                                # gguf and fp32, the default paths, 3 rounds
    python benchmarks/one_stream.py --llama-server /path/to/llama-server --rounds 5
    python benchmarks/one_stream.py --quantizations gguf --paths "offline=offline:.,before=serve:HEAD,after=serve:."

One request at a time (a text prompt of --input-len tokens, exactly --output-len tokens, greedy,
`ignore_eos`) through each path:

  offline   `LLM.generate`'s loop (LLMEngine.outputs) in a process of its own, DELTA outputs timed
  async     AsyncLLM in a process of its own, no HTTP: the engine thread and an asyncio consumer
  serve     `pagoda serve`, streamed by `pagoda bench serve`'s client in this process
  llama-server  llama.cpp's server (--llama-server PATH, `-np 1`) on the model's GGUF

Every path is started once per quantization and stays up; the rounds then send one request to
each in turn, the order reversed every other round, so the machine's noise falls on all alike.
A path is "name=kind:REF [FLAGS...]": REF a git tree ("." the working tree, `git archive`d
otherwise, as server_overhead.py's ServerSpec), FLAGS added to `pagoda serve` (serve) or taken
as engine flags (offline, async: `--num-threads 1`, ...); a NAME=VALUE word among them is an
environment variable of the path's process (`OMP_WAIT_POLICY=PASSIVE`). Per request: TTFT, decode tok/s
((tokens - 1) over first to last token), ITL p50 / p99, and for served paths the CPU seconds the
server's processes and the client used per token. The table gives each path's medians over the
rounds and its ratio to the first path.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from server_overhead import ServerSpec, thread_cpu_s, tree_dir

KINDS = ("offline", "async", "serve", "llama-server")
DEFAULT_PATHS = ("offline=offline:.,async=async:.,serve-thread=serve:.,serve-process=serve:. --engine-process,"
                 "llama-server=llama-server")
QUANT_FLAGS = {"gguf": ["--quantization", "gguf"], "fp32": ["--dtype", "float32"], "auto": []}


@dataclass
class PathSpec:
    """One path to measure, from "name=kind:REF [FLAGS...]" (llama-server takes neither)."""

    name: str
    kind: str
    server: ServerSpec = field(default_factory=lambda: ServerSpec("", "."))

    @classmethod
    def parse(cls, text: str) -> PathSpec:
        name, _, rest = text.strip().partition("=")
        kind, _, where = rest.partition(":")
        if kind not in KINDS:
            raise ValueError(f"path {text!r}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
        return cls(name, kind, ServerSpec.parse(f"{name}={where or '.'}"))

    @property
    def env(self) -> dict[str, str]:
        """The NAME=VALUE words among the flags: environment variables of the path's process."""
        return dict(f.split("=", 1) for f in self.server.flags if _is_env(f))

    @property
    def flags(self) -> list[str]:
        return [f for f in self.server.flags if not _is_env(f)]


def _is_env(word: str) -> bool:
    name, eq, _ = word.partition("=")
    return bool(eq) and name.isupper() and not name.startswith("-")


# -- the in-process paths: a child process that runs one request per line of stdin ------------

def _child_main(kind: str, model: str, flags: list[str]) -> None:
    """Load the engine, then for each JSON line {"prompt", "output_len", "id"} on stdin run it and
    print {"stamps": [seconds since submission of each token]}: offline through LLMEngine.outputs
    (the loop of LLM.generate), async through AsyncLLM with its engine thread."""
    from pagoda.config import create_engine_config
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.engine_args import EngineArgs
    from pagoda.sampling_params import RequestOutputKind, SamplingParams

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--model", model, *flags]))
    async_engine = None
    if kind == "async":
        from pagoda.engine.async_llm import AsyncLLM

        async_engine = AsyncLLM(create_engine_config(args))
    else:
        engine = LLMEngine(create_engine_config(args))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        params = SamplingParams(max_tokens=job["output_len"], temperature=0.0, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        stamps: list[float] = []
        start = time.perf_counter()
        if async_engine is None:
            engine.add_request(job["id"], job["prompt"], params)
            for out in engine.outputs():
                stamps += [time.perf_counter() - start] * len(out.outputs[0].token_ids)
        else:
            asyncio.run(_consume(async_engine, job, params, start, stamps))
        print(json.dumps({"stamps": stamps}), flush=True)


async def _consume(async_engine, job: dict, params, start: float, stamps: list[float]) -> None:
    """The async path's request: each delta's tokens stamped as the consumer gets them."""
    async for out in async_engine.generate(job["prompt"], params, job["id"]):
        stamps.extend([time.perf_counter() - start] * len(out.outputs[0].token_ids))


class ChildPath:
    """An offline / async path: its child process, fed one request at a time."""

    def __init__(self, spec: PathSpec, tree: Path, model: str, flags: list[str]) -> None:
        env = dict(os.environ, PYTHONPATH=str(tree), **spec.env)
        cmd = [sys.executable, str(HERE / "one_stream.py"), "--child", spec.kind, "--model", model, "--",
               *flags, *spec.flags]
        self.proc = subprocess.Popen(cmd, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._read()  # {"ready": true}

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the child exited with {self.proc.wait()}")
        return json.loads(line)

    def run(self, prompt: str, output_len: int, request_id: str) -> dict:
        self.proc.stdin.write(json.dumps({"prompt": prompt, "output_len": output_len, "id": request_id}) + "\n")
        self.proc.stdin.flush()
        stamps = self._read()["stamps"]
        return _timing(stamps[0], [b - a for a, b in zip(stamps, stamps[1:])], len(stamps))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


# -- the served paths -------------------------------------------------------------------------

def _tree_cpu_s(pid: int) -> float:
    """CPU seconds used so far by a process and its children (the engine process, if any)."""
    total = sum(u + k for u, k in thread_cpu_s(pid).values())
    with contextlib.suppress(OSError):
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            total += _tree_cpu_s(int(child))
    return total


class ServedPath:
    """A server (pagoda serve or llama-server), streamed by the benchmark's own client."""

    def __init__(self, spec: PathSpec, tree: Path, model: str, flags: list[str], ns: argparse.Namespace) -> None:
        from pagoda.bench import servers

        self.port = servers.free_port()
        if spec.kind == "serve":
            cmd = ["env", "-C", str(tree), *(f"{k}={v}" for k, v in spec.env.items()), *servers.pagoda_command(
                model, self.port, "--kv-cache-memory", str(ns.kv_cache_memory), *flags, *spec.flags)]
        else:
            cmd = _llama_server_command(model, self.port, ns)
        self._context = servers.running_process(cmd, self.port)
        self.base, self.proc = self._context.__enter__()
        self.model = model if spec.kind == "serve" else None

    def run(self, prompt: str, output_len: int, request_id: str) -> dict:
        from pagoda.bench import datasets, serve

        cfg = serve.ServeConfig(base_url=self.base, model=self.model)
        request = datasets.SampleRequest(prompt, 0, output_len)
        server_before, client_before = _tree_cpu_s(self.proc.pid), time.process_time()
        _, results = asyncio.run(serve.benchmark(cfg, [request], warmup=False))
        server_cpu, client_cpu = _tree_cpu_s(self.proc.pid) - server_before, time.process_time() - client_before
        result = results[0]
        if not result.success:
            raise RuntimeError(f"the request failed: {result.error}")
        timing = _timing(result.ttft, result.itl, result.output_tokens)
        timing.update(server_cpu_ms_per_token=server_cpu / result.output_tokens * 1e3,
                      client_cpu_ms_per_token=client_cpu / result.output_tokens * 1e3)
        return timing

    def close(self) -> None:
        self._context.__exit__(None, None, None)


def _llama_server_command(model: str, port: int, ns: argparse.Namespace) -> list[str]:
    from pagoda.bench import baselines

    if not ns.llama_server or not Path(ns.llama_server).exists():
        raise baselines.Unavailable("no llama-server binary (pass --llama-server PATH)")
    gguf = baselines.gguf_file(model)
    if gguf is None:
        raise baselines.Unavailable(f"llama.cpp needs a GGUF model; {model!r} is not one")
    threads = str(ns.threads or baselines.default_threads())
    return [ns.llama_server, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", "1",
            "-c", str(ns.input_len + ns.output_len + 64), "-t", threads, "-tb", threads, "--no-webui"]


def _timing(ttft: float, itl: list[float], tokens: int) -> dict:
    decode_s = sum(itl)
    ordered = sorted(itl)
    return {"tokens": tokens, "ttft_ms": ttft * 1e3, "decode_tok_s": len(itl) / decode_s if decode_s else 0.0,
            "itl_p50_ms": statistics.median(itl) * 1e3 if itl else 0.0,
            "itl_p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3 if itl else 0.0}


# -- the run ----------------------------------------------------------------------------------

def measure(quant: str, specs: list[PathSpec], trees: dict[str, Path], prompts: list[str],
            ns: argparse.Namespace) -> dict:
    """Start every path of one quantization, then the rounds; returns {name: [per-round timing]}."""
    from pagoda.bench import baselines
    from pagoda.bench.serve import loadavg

    flags = QUANT_FLAGS[quant]
    paths, runs, skipped = {}, {}, {}
    try:
        for spec in specs:
            if spec.kind == "llama-server" and quant not in ("gguf", "auto"):  # auto: a GGUF on its blocks
                continue
            print(f"{quant}: starting {spec.name}", file=sys.stderr, flush=True)
            tree = trees[spec.server.ref]
            try:
                paths[spec.name] = (ChildPath(spec, tree, ns.model, flags) if spec.kind in ("offline", "async")
                                    else ServedPath(spec, tree, ns.model, flags, ns))
            except (baselines.Unavailable, RuntimeError) as e:  # no binary, or it failed to start
                skipped[spec.name] = str(e)[:500]
                print(f"skipping {spec.name}: {e}", file=sys.stderr)
        names = list(paths)
        for name in names:  # a warm-up request each: every step shape once, not measured
            paths[name].run(prompts[0], 8, f"warmup-{name}")
        runs = {name: [] for name in names}
        for r in range(ns.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                timing = paths[name].run(prompts[r % len(prompts)], ns.output_len, f"r{r}-{name}")
                timing["loadavg_1m"] = loadavg()
                runs[name].append(timing)
                print(f"{quant} round {r + 1} {name}: {timing['decode_tok_s']:.1f} tok/s, "
                      f"ITL p50 {timing['itl_p50_ms']:.1f} ms, load {timing['loadavg_1m']}", file=sys.stderr, flush=True)
    finally:
        for path in paths.values():
            with contextlib.suppress(Exception):
                path.close()
    return {"runs": runs, "median": {name: _medians(rs) for name, rs in runs.items()}, "skipped": skipped}


def _medians(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if isinstance(runs[0][k], (int, float))]
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def format_table(quant: str, medians: dict[str, dict]) -> str:
    first = next(iter(medians.values()))["decode_tok_s"]
    lines = [f"\n{quant}: one stream, medians over the rounds\n",
             "| path | decode tok/s | vs first | ITL p50 (ms) | ITL p99 (ms) | TTFT (ms) | server CPU ms/token | client CPU ms/token |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    def cpu(m: dict, key: str) -> str:  # served paths only
        return f"{m[key]:.2f}" if key in m else ""

    for name, m in medians.items():
        lines.append(f"| {name} | {m['decode_tok_s']:.1f} | {m['decode_tok_s'] / first:.2f}x | {m['itl_p50_ms']:.2f} "
                     f"| {m['itl_p99_ms']:.1f} | {m['ttft_ms']:.0f} | {cpu(m, 'server_cpu_ms_per_token')} "
                     f"| {cpu(m, 'client_cpu_ms_per_token')} |")
    return "\n".join(lines)


def main() -> int:
    if "--child" in sys.argv:  # the offline / async path's process
        ap = argparse.ArgumentParser()
        ap.add_argument("--child", choices=("offline", "async"))
        ap.add_argument("--model")
        ns, flags = ap.parse_known_args()
        _child_main(ns.child, ns.model, [f for f in flags if f != "--"])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--quantizations", default="gguf,fp32", help=f"comma-separated, of {', '.join(QUANT_FLAGS)}")
    ap.add_argument("--paths", default=DEFAULT_PATHS, help="comma-separated name=kind:REF [FLAGS...] (module docstring)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--kv-cache-memory", type=float, default=2.0)
    ap.add_argument("--llama-server", default=None, help="path of llama.cpp's llama-server binary")
    ap.add_argument("--threads", type=int, default=None, help="llama-server's threads (default: all cores)")
    ap.add_argument("--save", default=None, help="JSON path (default: benchmarks/results/one-stream-<date>.json)")
    ns = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from pagoda.bench import datasets
    from pagoda.platform import benchmark_cpu_flags, cpu_model

    specs = [PathSpec.parse(p) for p in ns.paths.split(",") if p.strip()]
    unknown = {q.strip() for q in ns.quantizations.split(",")} - set(QUANT_FLAGS)
    if unknown:
        ap.error(f"unknown quantizations {sorted(unknown)}; known: {', '.join(QUANT_FLAGS)}")
    tokenizer = datasets.load_tokenizer(ns.model)
    prompts = [r.prompt for r in datasets.random_requests(max(ns.rounds, 1), ns.input_len, ns.output_len,
                                                          tokenizer=tokenizer, seed=0)]
    record: dict = {"date": date.today().isoformat(), "command": " ".join(sys.argv), "args": vars(ns),
                    "cpu": cpu_model(), "cpu_flags": benchmark_cpu_flags(), "nproc": os.cpu_count(),
                    "paths": [vars(s) | {"server": vars(s.server)} for s in specs], "results": {}}
    with contextlib.ExitStack() as stack:
        trees = {ref: stack.enter_context(tree_dir(ref)) for ref in {s.server.ref for s in specs}}
        for quant in (q.strip() for q in ns.quantizations.split(",") if q.strip()):
            result = record["results"][quant] = measure(quant, specs, trees, prompts, ns)
            print(format_table(quant, result["median"]), flush=True)
    save = Path(ns.save) if ns.save else HERE / "results" / f"one-stream-{date.today().isoformat()}.json"
    save.parent.mkdir(parents=True, exist_ok=True)
    save.write_text(json.dumps(record, indent=2, default=str))
    print(f"saved {save}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
