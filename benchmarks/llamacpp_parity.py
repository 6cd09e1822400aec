"""Greedy output of pagoda's default mode (a GGUF on its own blocks) against llama.cpp's on the same
file: how many tokens agree before the first difference.

    python benchmarks/llamacpp_parity.py --llama-server /path/to/llama-server \\
        --models smollm2-135m-Q4_K_M.gguf,smollm2-135m-Q6_K.gguf --max-tokens 48

Both compute in another order (llama.cpp: q8_K activations per 256 for the K-quants, its own
accumulation order; pagoda: int8 per 32), so they agree up to a near-tie between two tokens,
after which the texts part. Each prompt is sent raw to both (`/v1/completions`, temperature 0,
the same token ids: both tokenize with the file's vocabulary). Writes
results/llamacpp-parity-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "In 1492, Christopher Columbus",
    "The quick brown fox",
    "To make a cup of tea, first",
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(cmd: list[str], port: int) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}")
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{cmd} did not become healthy")


def _complete(port: int, prompt: str, max_tokens: int) -> str:
    model = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def _agreement(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare(model: str, ns: argparse.Namespace) -> dict:
    from pagoda.loader.gguf_model_dir import load_gguf_model_dir
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(load_gguf_model_dir(Path(model))))
    texts: dict[str, list[str]] = {}
    servers = {"pagoda": [sys.executable, "-m", "pagoda.cli", "serve", "--model", model],
               "llama.cpp": [ns.llama_server, "-m", model, "-np", "1", "-c", "2048", "--no-webui"]}
    for name, cmd in servers.items():
        port = _port()
        cmd = cmd + (["--port", str(port), "--host", "127.0.0.1"])
        proc = _serve(cmd, port)
        try:
            texts[name] = [_complete(port, p, ns.max_tokens) for p in PROMPTS]
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    rows = []
    for prompt, a, b in zip(PROMPTS, texts["pagoda"], texts["llama.cpp"]):
        ta, tb = tokenizer.encode(a, add_special_tokens=False), tokenizer.encode(b, add_special_tokens=False)
        rows.append({"prompt": prompt, "pagoda": a, "llama.cpp": b, "tokens": min(len(ta), len(tb)),
                     "agree_before_first_difference": _agreement(ta, tb)})
    return {"model": model, "prompts": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--models", required=True, help="comma-separated GGUF paths")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--save", type=Path, default=None)
    ns = ap.parse_args()
    from pagoda.platform import benchmark_cpu_flags, cpu_model

    record = {"date": date.today().isoformat(), "command": " ".join(sys.argv), "cpu": cpu_model(),
              "cpu_flags": benchmark_cpu_flags(), "nproc": os.cpu_count(), "results": []}
    for model in ns.models.split(","):
        result = compare(model, ns)
        record["results"].append(result)
        agree = [r["agree_before_first_difference"] for r in result["prompts"]]
        whole = sum(a == r["tokens"] for a, r in zip(agree, result["prompts"]))
        print(f"{Path(model).name}: {whole} of {len(agree)} prompts identical; tokens before the first "
              f"difference {agree}", flush=True)
    save = ns.save or HERE / "results" / f"llamacpp-parity-{record['date']}.json"
    save.write_text(json.dumps(record, indent=2))
    print(f"saved {save}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
