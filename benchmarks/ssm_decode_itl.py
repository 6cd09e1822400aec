"""Decode inter-token latency against context length: a Mamba-2 hybrid (Bamba), a pure Mamba-2 and
a transformer (Llama) of about the same size. A mixer's state does not grow with the context, an
attention layer's KV does, so the transformer's ITL should climb with the context and the
state-space models' stay flat (the hybrid's one attention layer in eight climbs an eighth as fast).

    python benchmarks/ssm_decode_itl.py [--contexts 256 1024 2048 4096] [--tokens 32] [--rounds 3]

The models are random-weight, built once under /tmp/ssm-bench from transformers configs of one
shape (hidden 1024, 8 layers, SwiGLU MLP 2816 where the family has one; Llama: 16 heads of 64,
4 KV heads; Bamba: layer 4 that attention, the 7 others Mamba-2 mixers of 32 heads of 64, state 64;
Mamba-2: 8 mixers, no MLP, so 16 layers of them to match the size). fp32 on the CPU. For each
context length, one request alone: a prompt of that many tokens, then --tokens greedy tokens;
ITL is the median time between tokens after the first (the median of --rounds); beside it the
fastest gap of any round: on a shared machine, the step's cost when nothing else took the cores. Writes
results/ssm-decode-itl-<date>.json with the CPU flags and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).parent
ROOT = Path("/tmp/ssm-bench")
HIDDEN, LAYERS, MLP = 1024, 8, 2816  # (16384 positions: contexts up to 16k)


def _configs(max_position: int = 16384) -> dict:
    import transformers

    common = dict(vocab_size=384, hidden_size=HIDDEN, num_hidden_layers=LAYERS, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, tie_word_embeddings=False)
    attention = dict(intermediate_size=MLP, num_attention_heads=16, num_key_value_heads=4,
                     max_position_embeddings=max_position)
    return {
        "llama": transformers.LlamaConfig(**common, **attention),
        "bamba": transformers.BambaConfig(**common, **attention, attn_layer_indices=[4], mamba_n_heads=32,
                                          mamba_d_head=64, mamba_d_state=64, mamba_n_groups=1, mamba_chunk_size=256),
        # (no position embeddings: max_position_embeddings only tells pagoda the context it may take)
        "mamba2": transformers.Mamba2Config(**{**common, "num_hidden_layers": 2 * LAYERS}, num_heads=32, head_dim=64,
                                            state_size=64, n_groups=1, chunk_size=256,
                                            max_position_embeddings=max_position),
    }


def build(name: str, config) -> tuple[Path, int]:
    """The model's directory (built once) and its parameter count."""
    import torch
    import transformers

    sys.path.insert(0, str(HERE.parent / "tests"))
    from tiny_models import make_tokenizer

    out = ROOT / name
    if not (out / "config.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        make_tokenizer(out)
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return out, params


def itl(model: Path, context: int, tokens: int) -> tuple[float, float, float]:
    """(median ITL, fastest inter-token gap, TTFT) in ms of one request alone: ``context`` prompt
    tokens, ``tokens`` out. The fastest gap is the step's cost when nothing else took the cores."""
    from pagoda import LLM, SamplingParams

    llm = LLM(model=str(model), dtype="float32", kv_cache_memory=1.0, enable_prefix_caching=False,
              max_model_len=context + tokens + 16)
    engine = llm.engine
    prompt = [(i * 7919) % 380 + 3 for i in range(context)]
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=tokens,
                                                                         ignore_eos=True))
    start, stamps = time.perf_counter(), []
    while engine.has_unfinished_requests():
        if engine.step():
            stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return statistics.median(gaps) * 1e3, min(gaps) * 1e3, (stamps[0] - start) * 1e3


def plot(rows: list[dict], path: Path) -> None:
    """ITL against context length, a line a model (the fastest gap of the rounds: the machine's
    noise only ever adds)."""
    import matplotlib  # deferred: only for the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == name]
        ax.plot([r["context"] for r in mine], [r["fastest_ms"] for r in mine], marker="o",
                label=f"{name} ({mine[0]['params'] / 1e6:.0f}M)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("inter-token latency, one stream (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title("Decode ITL against context: state-space models stay flat")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048, 4096])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=["llama", "bamba", "mamba2"])
    parser.add_argument("--plot-only", type=Path, default=None, metavar="RESULTS_JSON",
                        help="draw the figure of an earlier run's results, without measuring")
    a = parser.parse_args()
    if a.plot_only is not None:
        plot(json.loads(a.plot_only.read_text())["rows"], HERE / "ssm_decode_itl.png")
        return
    configs = _configs()
    rows = []
    for name in a.models:
        path, params = build(name, configs[name])
        for context in a.contexts:
            runs = [itl(path, context, a.tokens) for _ in range(a.rounds)]
            rows.append({"model": name, "params": params, "context": context,
                         "itl_ms": statistics.median(r[0] for r in runs), "fastest_ms": min(r[1] for r in runs),
                         "ttft_ms": statistics.median(r[2] for r in runs),
                         "itl_rounds_ms": [round(r[0], 2) for r in runs]})
            print(json.dumps(rows[-1]), flush=True)
    flags = sorted({f for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
                    for f in line.split() if f.startswith(("avx2", "avx512", "amx"))})
    out = HERE / "results" / f"ssm-decode-itl-{date.today()}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"cpu_flags": flags, "args": vars(a), "rows": rows}, indent=2))
    plot(rows, HERE / "ssm_decode_itl.png")
    print("\n| model | params | " + " | ".join(f"ITL at {c}" for c in a.contexts) + " |")
    print("| --- | ---: | " + " | ".join("---:" for _ in a.contexts) + " |")
    for name in a.models:
        mine = [r for r in rows if r["model"] == name]
        print(f"| {name} | {mine[0]['params'] / 1e6:.0f}M | "
              + " | ".join(f"{r['itl_ms']:.1f} ms (fastest {r['fastest_ms']:.1f})" for r in mine) + " |")


if __name__ == "__main__":
    main()
