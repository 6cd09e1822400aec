"""Chunked attention over an image's patches (issue 46 item 1; the seed's 004 §5): peak memory
and time per image of the vision tower's attention, in query chunks against all patches at once.

    python benchmarks/vision_attention.py [--patches 4096] [--layers 1] [--chunks 0,1024,512,256]

Gemma 3's SigLIP-so400m shapes (hidden 1152, 16 heads, MLP 4304; 896 px in 14 px patches: 4096
patches), random weights, fp32, one image, ``--layers`` encoder layers (the attention's memory is
a layer's: the layers run one after another). Each configuration runs in a fresh process, which
reports its peak resident memory above what the model and the image hold, and the median of
three forwards. Two attentions: pagoda's (``F.scaled_dot_product_attention``, whose CPU kernel
tiles the keys itself) and the textbook one that holds every score (softmax(QK^T)V, as
transformers' "eager" attention), which chunking is for. Prints one JSON line per configuration.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

SIGLIP_SO400M = {"hidden_size": 1152, "intermediate_size": 4304, "num_attention_heads": 16, "patch_size": 14,
                 "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6}


def _eager(q, k, v, scale=None, **_):
    """Attention with every score held at once (transformers' eager attention)."""
    weights = torch.softmax((q @ k.transpose(-1, -2)) * scale, dim=-1)
    return weights @ v


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def one(patches: int, layers: int, chunk: int, attention: str) -> dict:
    """One configuration in this process: (peak MiB above the model and image, ms per image)."""
    from pagoda.models import siglip
    from pagoda.models.siglip import SiglipVisionTower

    if attention == "eager":
        siglip.F.scaled_dot_product_attention = _eager  # (this process only)
    side = int(patches ** 0.5)
    cfg = {**SIGLIP_SO400M, "image_size": side * 14, "num_hidden_layers": layers}
    torch.manual_seed(0)
    tower = SiglipVisionTower(cfg).eval()
    for p in tower.parameters():
        p.data.normal_(0, 0.02)
    tower.attention_chunk = chunk or None
    image = torch.randn(1, 3, cfg["image_size"], cfg["image_size"])
    with torch.inference_mode():
        tower.embeddings(image)  # warm the conv's workspace before the baseline
        base = _peak_mib()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            out = tower(image)
            times.append(time.perf_counter() - start)
    return {"patches": patches, "layers": layers, "attention": attention, "chunk": chunk or "all",
            "peak_mib": round(_peak_mib() - base, 1), "ms_per_image": round(1000 * statistics.median(times), 1),
            "checksum": round(float(out.double().sum()), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--patches", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--chunks", default="0,1024,512,256", help="query chunk sizes; 0: all patches at once")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # chunk, attention: run in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.patches, args.layers, int(args.one[0]), args.one[1])))
        return
    for attention in ("sdpa", "eager"):
        for chunk in [int(c) for c in args.chunks.split(",")]:
            out = subprocess.run([sys.executable, __file__, "--patches", str(args.patches), "--layers",
                                  str(args.layers), "--one", str(chunk), attention],
                                 capture_output=True, text=True, check=True)
            print(out.stdout.strip(), flush=True)


if __name__ == "__main__":
    main()
