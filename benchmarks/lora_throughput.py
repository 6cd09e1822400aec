"""LoRA serving cost (issue 45): 16 streams over 4 adapters in one batch, against 16 streams on the
base model alone and against the 4 adapters run one after another; adapter load time and memory.

    python benchmarks/lora_throughput.py [--model smollm2] [--rank 16] [--tokens 64] [--rounds 3]

Offline engine (pagoda.LLM), greedy, ignore_eos, one engine for all three (the base runs with
enable_lora on too, so the comparison is the adapters' cost, not a different engine). The adapters
are random PEFT files of the model's shapes (speed does not depend on their values), every
projection targeted. Prints one JSON line per round and a summary (medians).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from pagoda import LLM, SamplingParams
from pagoda.lora import LoRARequest
from pagoda.lora.adapter_files import read_adapter
from pagoda.lora.binding import adapter_nbytes, bind_adapter

PROJECTIONS = {"q_proj": ("hidden", "q"), "k_proj": ("hidden", "kv"), "v_proj": ("hidden", "kv"),
               "o_proj": ("q", "hidden"), "gate_proj": ("hidden", "inter"), "up_proj": ("hidden", "inter"),
               "down_proj": ("inter", "hidden")}


def write_adapter(out: Path, hf_config: dict, rank: int, seed: int) -> Path:
    """A PEFT adapter of random pairs for every projection of every layer."""
    hidden, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hidden // heads
    sizes = {"hidden": hidden, "q": heads * head_dim, "inter": hf_config["intermediate_size"],
             "kv": (hf_config.get("num_key_value_heads") or heads) * head_dim}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config["num_hidden_layers"]):
        for name, (fan_in, fan_out) in PROJECTIONS.items():
            block = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, sizes[fan_in], generator=g) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(sizes[fan_out], rank, generator=g) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                         "target_modules": list(PROJECTIONS)}))
    return out


def run(llm: LLM, prompts: list[str], params: SamplingParams, loras) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lora-dtype", default="auto")
    ap.add_argument("--no-fused-decode", action="store_true", help="the base on the Python layers too")
    args = ap.parse_args()
    llm = LLM(model=args.model, quantization=args.quantization, enable_lora=True, max_loras=4,
              max_lora_rank=args.rank, kv_cache_memory=1.0, enable_prefix_caching=False, lora_dtype=args.lora_dtype,
              fused_decode=not args.no_fused_decode)
    hf_config = llm.engine.config.model.hf_config
    root = Path(tempfile.mkdtemp())
    paths = [write_adapter(root / f"a{i}", hf_config, args.rank, i) for i in range(4)]
    loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    prompts = [f"Story {i}: once upon a time, in a land of many engines and a batch of sixteen," for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)

    started = time.perf_counter()
    adapter = read_adapter(str(paths[0]), hf_config, args.rank)
    read_s = time.perf_counter() - started
    model = llm.engine.core.executor.driver_worker.model
    started = time.perf_counter()
    deltas = bind_adapter(model, adapter, llm.engine.config.lora.dtype)
    bind_s = time.perf_counter() - started
    run(llm, prompts[:4], params, [loras[0]] * 4)  # warm: kernels, the adapters loaded once

    rows = []
    for r in range(args.rounds):
        base_s, base_n = run(llm, prompts, params, None)
        mixed_s, mixed_n = run(llm, prompts, params, [loras[i % 4] for i in range(16)])
        seq = [run(llm, prompts[4 * i:4 * i + 4], params, [loras[i]] * 4) for i in range(4)]
        seq_s, seq_n = sum(s for s, _ in seq), sum(n for _, n in seq)
        row = {"round": r, "base_tok_s": base_n / base_s, "mixed_tok_s": mixed_n / mixed_s,
               "one_after_another_tok_s": seq_n / seq_s}
        rows.append(row)
        print(json.dumps(row), flush=True)
    median = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "round"}
    print(json.dumps({"model": args.model, "quantization": llm.engine.config.model.quantization, "rank": args.rank,
                      "lora_dtype": str(llm.engine.config.lora.dtype), "fused_decode": not args.no_fused_decode,
                      "streams": 16, "adapters": 4, "tokens": args.tokens, **{k: round(v, 1) for k, v in median.items()},
                      "mixed_vs_base": round(median["mixed_tok_s"] / median["base_tok_s"], 3),
                      "mixed_vs_one_after_another": round(median["mixed_tok_s"] / median["one_after_another_tok_s"], 3),
                      "adapter_read_ms": round(read_s * 1e3, 1), "adapter_bind_ms": round(bind_s * 1e3, 1),
                      "adapter_mib": round(adapter_nbytes(deltas) / 2**20, 2)}))


if __name__ == "__main__":
    main()
