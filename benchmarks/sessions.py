"""Per-turn cost of a long conversation: server-side sessions against pasting the whole history.

    python benchmarks/sessions.py [--turns 16] [--model smollm2-135m-instruct]

The seeds' failure case: a chat service that sends the whole history with every turn, so each
turn costs more than the last. One conversation of `--turns` user messages (~70 tokens each,
answers of 24 tokens, greedy) is replayed three ways, each on its own `pagoda serve` of the GGUF
fast path (--quantization gguf), with other traffic between the turns (`--filler` distinct
prompts of ~1,100 tokens) that wants the KV cache's room:

- `session`: `/v1/sessions`, each turn only its new message (incremental encoding, pinned prefix);
- `pasted, prefix cache`: `/v1/chat/completions` with the whole history, prefix caching on (the
  history is reused when it is still cached: LRU, so the other traffic may evict it);
- `pasted, no cache`: the same with `--no-enable-prefix-caching` (the seeds' failure case).

Measured per turn: the prompt tokens, the tokens computed (prompt - cached), the time to first
token (streamed). Writes results/sessions-<date>.json and .png, prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import date
from pathlib import Path

import httpx

HERE = Path(__file__).parent
TOPICS = ["the harbour", "a mountain village", "an old library", "a night train", "a desert market",
          "a research station", "a river delta", "a glass factory"]


def user_message(turn: int) -> str:
    topic = TOPICS[turn % len(TOPICS)]
    return (f"Turn {turn}. Tell me one new detail about {topic}: who works there, what they eat for "
            f"breakfast, which sounds they hear at dawn, and what they worry about when the weather turns. "
            f"Keep it to two sentences and do not repeat anything you said about {topic} before.")


def filler_prompt(turn: int, i: int) -> str:
    words = " ".join(f"w{turn}x{i}y{k}" for k in range(150))
    return f"Other traffic {turn}-{i}: {words}"


def stream_turn(client: httpx.Client, path: str, body: dict) -> dict:
    """POST a streamed chat-shaped request; returns its text, usage and time to first token."""
    start = time.perf_counter()
    first, text, usage = None, "", None
    with client.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter() - start
                text += piece
    return {"text": text, "usage": usage, "ttft": first if first is not None else time.perf_counter() - start,
            "total": time.perf_counter() - start}


def run_mode(base: str, mode: str, turns: int, filler: int, answer_tokens: int) -> list[dict]:
    sampling = {"max_tokens": answer_tokens, "temperature": 0, "ignore_eos": True}
    system = "You are a storyteller who answers in two short sentences."
    rows = []
    with httpx.Client(base_url=base, timeout=600) as client:
        history: list[dict] = [{"role": "system", "content": system}]
        sid = client.post("/v1/sessions", json={"system": system, **sampling}).json()["id"] if mode == "session" else None
        for turn in range(turns):
            message = user_message(turn)
            if sid is not None:
                result = stream_turn(client, f"/v1/sessions/{sid}/messages", {"content": message})
            else:
                result = stream_turn(client, "/v1/chat/completions",
                                     {"messages": history + [{"role": "user", "content": message}], **sampling})
            history += [{"role": "user", "content": message}, {"role": "assistant", "content": result["text"]}]
            usage = result["usage"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            rows.append({"turn": turn + 1, "prompt_tokens": usage["prompt_tokens"],
                         "computed_tokens": usage["prompt_tokens"] - cached, "ttft_s": round(result["ttft"], 4),
                         "turn_s": round(result["total"], 4)})
            print(f"{mode:>22} turn {turn + 1:2d}: prompt {usage['prompt_tokens']:5d}, computed "
                  f"{usage['prompt_tokens'] - cached:5d}, ttft {result['ttft']:.3f} s", flush=True)
            for i in range(filler):
                client.post("/v1/completions", json={"prompt": filler_prompt(turn, i), "max_tokens": 1,
                                                     "temperature": 0}).raise_for_status()
    return rows


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, rows in results["modes"].items():
        turns = [r["turn"] for r in rows]
        left.plot(turns, [r["computed_tokens"] for r in rows], marker="o", label=mode)
        right.plot(turns, [r["ttft_s"] for r in rows], marker="o", label=mode)
    left.set(xlabel="turn", ylabel="prompt tokens computed", title="Prefill work per turn")
    right.set(xlabel="turn", ylabel="time to first token (s)", title="Latency per turn")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{results['model']} on {results['cpu']} ({results['threads']} threads)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    from pagoda.bench.servers import free_port, pagoda_command, running
    from pagoda.platform import benchmark_cpu_flags, cpu_model

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--turns", type=int, default=16)
    parser.add_argument("--filler", type=int, default=4, help="other requests between two turns")
    parser.add_argument("--answer-tokens", type=int, default=24)
    parser.add_argument("--kv-cache-memory", default="0.2", help="GiB: small, so that the other traffic competes")
    ns = parser.parse_args()
    serve_args = ["--quantization", "gguf", "--kv-cache-memory", ns.kv_cache_memory, "--max-model-len", "4096"]
    modes = {"session": [], "pasted, prefix cache": [], "pasted, no cache": ["--no-enable-prefix-caching"]}
    import os

    results = {"model": ns.model, "cpu": cpu_model(), "cpu_flags": benchmark_cpu_flags(), "threads": os.cpu_count(),
               "turns": ns.turns, "filler": ns.filler, "answer_tokens": ns.answer_tokens,
               "serve_args": serve_args, "command": "python benchmarks/sessions.py " + " ".join(
                   f"--{k.replace('_', '-')} {v}" for k, v in vars(ns).items()), "modes": {}}
    for mode, extra in modes.items():
        port = free_port()
        with running(pagoda_command(ns.model, port, *serve_args, *extra), port) as base:
            results["modes"][mode] = run_mode(base, mode, ns.turns, ns.filler, ns.answer_tokens)
    out = HERE / "results" / f"sessions-{date.today()}"
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    plot(results, out.with_suffix(".png"))
    print(f"\n| turn | prompt tokens | " + " | ".join(f"{m}: computed / TTFT" for m in modes) + " |")
    print("|---|---|" + "---|" * len(modes))
    for i in range(ns.turns):
        cells = [f"{results['modes'][m][i]['computed_tokens']} / {results['modes'][m][i]['ttft_s']:.3f} s" for m in modes]
        print(f"| {i + 1} | {results['modes']['session'][i]['prompt_tokens']} | " + " | ".join(cells) + " |")
    print(f"\nwrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
