"""gRPC against HTTP SSE on one server: the per-token cost of each transport at 64 streams.

    python benchmarks/grpc_vs_sse.py        # writes results/grpc-vs-sse-<date>.json

One `pagoda serve --grpc-port` of SmolLM2-135M-Instruct (fp32, --max-num-seqs 64); 64 streams at
once, 64 tokens each (greedy, ignore_eos), through the async grpcio client (`Generate`) and through
httpx reading SSE (`/v1/completions`, stream), alternating, `--repeats` times each. Measured:
wall time and tokens/s, and the server process's CPU seconds per token (utime + stime from
/proc, its engine thread included), whose difference between the two is the transport's cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import httpx

HERE = Path(__file__).parent
MODEL = "smollm2-135m-instruct"
PROMPT = "Write a short story about a lighthouse keeper."


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _sse(base: str, streams: int, tokens: int) -> int:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        async def one() -> int:
            chunks = 0
            async with client.stream("POST", f"{base}/v1/completions", json=body) as answer:
                async for line in answer.aiter_lines():
                    if line.startswith("data: {"):
                        chunks += 1
            return chunks
        return sum(await asyncio.gather(*(one() for _ in range(streams))))


async def _grpc(target: str, streams: int, tokens: int) -> int:
    import grpc

    from pagoda.entrypoints.grpc_api import pagoda_pb2 as pb
    from pagoda.entrypoints.grpc_api import pagoda_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.EngineStub(channel)
        request = pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingOptions(max_tokens=tokens, temperature=0,
                                                                                ignore_eos=True))

        async def one() -> int:
            return sum([len(piece.token_ids) async for piece in stub.Generate(request)])
        return sum(await asyncio.gather(*(one() for _ in range(streams))))


def main() -> None:
    from pagoda.bench.servers import free_port
    from pagoda.platform import cpu_flags

    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    ns = parser.parse_args()
    port, grpc_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagoda.cli", "serve", "--model", MODEL, "--port",
                             str(port), "--grpc-port", str(grpc_port), "--dtype", "float32", "--max-num-seqs",
                             str(ns.streams), "--log-level", "warning"])
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        asyncio.run(_sse(base, 4, 8))  # warm-up, both paths
        asyncio.run(_grpc(f"127.0.0.1:{grpc_port}", 4, 8))
        runs = []
        for _ in range(ns.repeats):
            for transport in ("sse", "grpc"):
                cpu, start = _cpu_seconds(proc.pid), time.perf_counter()
                if transport == "sse":
                    count = asyncio.run(_sse(base, ns.streams, ns.tokens))
                else:
                    count = asyncio.run(_grpc(f"127.0.0.1:{grpc_port}", ns.streams, ns.tokens))
                wall, cpu = time.perf_counter() - start, _cpu_seconds(proc.pid) - cpu
                runs.append({"transport": transport, "tokens": ns.streams * ns.tokens, "pieces": count,
                             "wall_s": wall, "tokens_per_s": ns.streams * ns.tokens / wall,
                             "server_cpu_ms_per_token": 1000 * cpu / (ns.streams * ns.tokens)})
                r = runs[-1]
                print(f"{transport:>4}: {r['tokens_per_s']:.1f} tok/s, server CPU {r['server_cpu_ms_per_token']:.3f} "
                      f"ms/token, {r['wall_s']:.1f} s", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    out = HERE / "results" / f"grpc-vs-sse-{date.today()}.json"
    out.write_text(json.dumps({"date": str(date.today()), "model": MODEL, "streams": ns.streams, "tokens": ns.tokens,
                               "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma"))),
                               "runs": runs}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
