"""A `pagoda serve` start, from the process's start to the first token of a request sent at once,
with the whole-model load against progressive (layer by layer) loading.

    python benchmarks/progressive_load.py --model /work/shapes/1b-Q4_K_M.gguf --quantization gguf \
        --rounds 3 --first-start --save benchmarks/results/progressive-load-<date>.json

Each round starts one server per mode, alternated (whole, progressive, whole, ...), each a fresh
process on a free port. The parent connects as soon as the port is bound (the server binds it
before it loads the model, pagoda/entrypoints/openai/lifecycle.py), sends a streamed
``/v1/completions`` request at once (16 prompt tokens, 1 output token, greedy) and records when
the first token came and when ``/health`` first answered 200 (polled every 50 ms from another
thread). ``--first-start`` gives each start a fresh copy of ``PAGODA_HOME`` without the repacked
tiles (``repacked/``), as a replica's first start on a new machine; without it, the first round
fills the cache and is not counted.

The child also prints a timeline of the start (``--timeline``): when each phase of the load began
and ended, measured by wrapping the functions that do them (imports, engine configuration and
tokenizer, reading the weights, repacking, packing, the KV cache, the app, listening). It sets
OpenMP's spin as `pagoda serve` does (``configure_server_openmp``, before torch loads: a short spin
on a busy machine, libgomp's own on a quiet one), which decides much of a load's speed on shared
cores (benchmarks/README.md, "Progressive loading").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

# Runs in the server's process: wraps the phases' functions to print when each ran, then serves.
CHILD = r"""
import sys, time, functools, json
T0 = float(sys.argv[1])
def mark(name, start, end):
    print("TIMELINE " + json.dumps({"phase": name, "start": start - T0, "end": end - T0}), file=sys.stderr, flush=True)
started = time.time()
from pagoda.threads import configure_server_openmp
configure_server_openmp()  # as `pagoda serve` does before torch loads: the spin its OpenMP threads keep
import pagoda.entrypoints.openai.api_server as api_server
mark("imports", T0, time.time())
def wrap(owner, attr, name):
    original = getattr(owner, attr)
    @functools.wraps(original)
    def timed(*a, **k):
        s = time.time()
        try:
            return original(*a, **k)
        finally:
            mark(name, s, time.time())
    setattr(owner, attr, timed)
import pagoda.engine_args as ea, pagoda.loader.model_loader as ml, pagoda.worker.worker as ww
import pagoda.models.llama as llama, pagoda.engine.front_end as fe
import pagoda.layers.packed_weights as pw
wrap(api_server, "create_engine_config", "config")
wrap(llama.LlamaForCausalLM, "load_weights", "weights read")
wrap(ml, "quantize_linears", "repack")
import pagoda.loader.progressive_load as pl
wrap(pl._Stages, "prepare", "stages on the loader thread (read, repack, pack)")
for mod in (ml, pw):
    wrap(mod, "pack_block_linears", "pack")
    wrap(mod, "pack_float_linears", "pack")
wrap(ww, "load_model", "load_model (whole, or until the loader starts)")
wrap(ww.Worker, "determine_num_blocks", "KV sizing")
wrap(ww.Worker, "initialize_cache", "KV allocation")
wrap(fe.FrontEnd, "__init__", "front end (tokenizer, core)")
wrap(api_server, "build_app", "app")
import pagoda.entrypoints.openai.lifecycle as lc
orig_run = lc.DrainingServer.run
def run(self, *a, **k):
    mark("serving", time.time(), time.time())
    return orig_run(self, *a, **k)
lc.DrainingServer.run = run
from pagoda.cli import main
sys.exit(main(sys.argv[2:]))
"""

PROMPT = "one two three four five six seven eight nine ten eleven twelve thirteen"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen, deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.01)
    raise RuntimeError("the port was never bound")


def _poll_health(base: str, t0: float, out: dict, stop: threading.Event) -> None:
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            try:
                r = client.get(f"{base}/health")
                out.setdefault("first_answer_s", time.time() - t0)
                if r.status_code == 200:
                    out["health_200_s"] = time.time() - t0
                    return
            except httpx.HTTPError:
                pass
            stop.wait(0.05)


def one_start(model: str, extra: list[str], progressive: bool, home: str) -> dict:
    """One server start: seconds from its process's start to /health 200 and to the first token."""
    port = _free_port()
    flags = ["--progressive-load" if progressive else "--no-progressive-load"]
    argv = ["serve", "--model", model, "--port", str(port), "--served-model-name", "m", "--log-level", "warning",
            "--max-model-len", "512", *flags, *extra]
    env = dict(os.environ, PAGODA_HOME=home)
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(t0), *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env)
    base, health, stop = f"http://127.0.0.1:{port}", {}, threading.Event()
    try:
        _wait_for_port(port, proc, time.monotonic() + 600)
        bound = time.time() - t0
        poller = threading.Thread(target=_poll_health, args=(base, t0, health, stop), daemon=True)
        poller.start()
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as r:
            r.raise_for_status()
            first = None
            for line in r.iter_lines():
                if line.startswith("data: ") and first is None:
                    first = time.time() - t0
        poller.join(timeout=600)
    finally:
        stop.set()
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    timeline = [json.loads(ln.removeprefix("TIMELINE ")) for ln in err.splitlines() if ln.startswith("TIMELINE ")]
    return {"progressive": progressive, "bound_s": bound, "first_token_s": first,
            "health_200_s": health.get("health_200_s"), "timeline": _merge(timeline)}


def _merge(marks: list[dict]) -> list[dict]:
    """One row a phase: its first start, last end, and the seconds inside it (summed)."""
    rows: dict[str, dict] = {}
    for m in marks:
        row = rows.setdefault(m["phase"], {"phase": m["phase"], "start": m["start"], "end": m["end"], "busy": 0.0})
        row["start"], row["end"] = min(row["start"], m["start"]), max(row["end"], m["end"])
        row["busy"] += m["end"] - m["start"]
    return sorted(rows.values(), key=lambda r: r["start"])


def fresh_home(base: str, keep_repacked: bool) -> str:
    """A copy of ``base`` (symlinks to its kernels and models), with or without the repacked tiles."""
    home = tempfile.mkdtemp(prefix="pagoda-home-")
    for entry in Path(base).iterdir():
        if entry.name == "repacked" and not keep_repacked:
            continue
        os.symlink(entry.resolve(), Path(home) / entry.name)
    return home


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--quantization", default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--first-start", action="store_true", help="each start without the repacked tiles")
    p.add_argument("--modes", default="whole,progressive")
    p.add_argument("--save", type=Path, default=None)
    args = p.parse_args()
    base = os.environ.get("PAGODA_HOME") or str(Path.home() / ".pagoda")
    extra = ["--quantization", args.quantization] if args.quantization else []
    modes = [m == "progressive" for m in args.modes.split(",")]
    shared = None if args.first_start else fresh_home(base, keep_repacked=True)
    if shared is not None:  # a start that fills the repacked cache, not counted
        one_start(args.model, extra, False, shared)
    runs = []
    for round_ in range(args.rounds):
        for progressive in modes if round_ % 2 == 0 else modes[::-1]:
            home = fresh_home(base, keep_repacked=False) if args.first_start else shared
            run = one_start(args.model, extra, progressive, home)
            if args.first_start:
                shutil.rmtree(home, ignore_errors=True)
            run["round"] = round_
            runs.append(run)
            print(json.dumps({k: v for k, v in run.items() if k != "timeline"}), flush=True)
            for row in run["timeline"]:
                print(f"    {row['phase']:<48} {row['start']:7.2f} → {row['end']:7.2f} s (busy {row['busy']:.2f})")
    for progressive in modes:
        mine = [r for r in runs if r["progressive"] == progressive]
        ft = sorted(r["first_token_s"] for r in mine)
        hs = sorted(r["health_200_s"] for r in mine if r["health_200_s"] is not None)
        print(f"{'progressive' if progressive else 'whole'}: first token {ft[len(ft) // 2]:.2f} s "
              f"(min {ft[0]:.2f}), /health 200 {hs[len(hs) // 2]:.2f} s" if hs else "")
    if args.save:
        args.save.write_text(json.dumps({"model": args.model, "quantization": args.quantization,
                                         "first_start": args.first_start, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
