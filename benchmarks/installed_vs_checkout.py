"""One stream through `pagoda serve`, the installed package (non-editable, run from another
directory, an empty `PAGODA_HOME`) beside this checkout, alternated in one run.

    python benchmarks/installed_vs_checkout.py --model PATH.gguf --rounds 2 \
        --save benchmarks/results/installed-vs-checkout-<date>.json

The installed copy goes into a fresh venv (`--system-site-packages --without-pip`, this machine's
pip and build backend, `--no-build-isolation`: nothing downloaded), as tests/test_packaging.py
installs it; its first start builds its own kernels. Each server gets a warm-up request, then
`--requests` streamed completions of `--max-tokens` tokens (greedy, ignore_eos); a round's rate is
the best request's decode tokens/s after its first token.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Once upon a time in a land far away"


def install(tmp: Path) -> Path:
    """This checkout's HEAD, installed non-editable into a fresh venv; its `pagoda` command."""
    src, venv = tmp / "src", tmp / "venv"
    src.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "HEAD"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--force-reinstall", "--ignore-installed", "--no-index", str(src)], check=True)
    return venv / "bin" / "pagoda"


def decode_rate(port: int, requests: int, max_tokens: int) -> float:
    """The best streamed request's tokens/s after its first token."""
    best = 0.0
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    for _ in range(requests):
        first, n = None, 0
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    first = first or time.monotonic()
                    n += 1
        best = max(best, (n - 1) / (time.monotonic() - first))
    return best


def serve_and_measure(command: list[str], home: Path, model: str, port: int, args) -> tuple[float, str]:
    """(decode tokens/s, the server's start-up line: its OpenMP waiting policy and why)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PAGODA_DISABLE_KERNELS")}
    env["PAGODA_HOME"] = str(home)
    home.mkdir(parents=True, exist_ok=True)
    log = home / f"serve-{port}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([*command, "serve", model, "--quantization", "gguf", "--port", str(port),
                                 "--log-level", "warning"], cwd=tempfile.gettempdir(), env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600  # a first start builds the kernels
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        decode_rate(port, 1, 16)  # warm-up
        rate = decode_rate(port, args.requests, args.max_tokens)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    started = [line.strip() for line in log.read_text().splitlines() if "GOMP" in line or "spin" in line]
    return rate, started[0] if started else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a GGUF file (served with --quantization gguf)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--port", type=int, default=18321)
    ap.add_argument("--save", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="pagoda-installed-") as tmp:
        installed = install(Path(tmp))
        homes = {"checkout": Path(os.environ.get("PAGODA_HOME") or Path.home() / ".cache" / "pagoda"),
                 "installed": Path(tmp) / "home"}
        commands = {"checkout": [sys.executable, "-m", "pagoda.cli"], "installed": [str(installed)]}
        rates: dict[str, list[float]] = {"checkout": [], "installed": []}
        openmp: dict[str, list[str]] = {"checkout": [], "installed": []}
        for _ in range(args.rounds):
            for name in ("checkout", "installed"):
                rate, line = serve_and_measure(commands[name], homes[name], args.model, args.port, args)
                rates[name].append(round(rate, 1))
                openmp[name].append(line)
                print(name, rates[name][-1], "tok/s;", line, flush=True)
    ratios = [round(i / c, 3) for i, c in zip(rates["installed"], rates["checkout"])]
    flags = sorted({f for line in open("/proc/cpuinfo") if line.startswith("flags")
                    for f in line.split()[2:] if f.startswith(("avx", "amx", "fma", "f16c"))})
    result = {"model": args.model, "rates_tok_s": rates, "installed_over_checkout": ratios, "openmp": openmp,
              "cpu": platform.processor() or platform.machine(), "cpu_flags": flags, "cores": os.cpu_count()}
    print(json.dumps(result, indent=1))
    if args.save:
        args.save.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
