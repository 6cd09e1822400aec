"""The `pagoda quantize` subcommand's options and runner (argparse only at import)."""

from __future__ import annotations

import argparse
import json
import sys

DESCRIPTION = """\
Quantize a model's projections to 4- or 8-bit ggml blocks and write a GGUF that pagoda
(`--model OUT.gguf --quantization gguf`) and llama.cpp load.

  rtn   round to nearest, as llama.cpp's quantizer (no calibration)
  awq   activation-aware scaling: per-channel scales searched on the calibration activations
        (q/k/v's on the attention block's output, gate/up's on the MLP's) and folded into the
        preceding norm or projection, then a per-block clipping search
  gptq  second-order error compensation with the calibration inputs' Hessian, block by block

awq and gptq calibrate layer by layer: each layer's statistics are taken with the layers before
it already quantized.

--bits 4 writes Q4_0 (Q4_1 with --zero-point), --bits 8 Q8_0; the embedding / head are Q8_0.
Without --calibration, the public-domain set shipped with pagoda is used.
"""


def add_parser(sub) -> None:
    p = sub.add_parser("quantize", help="quantize a model to a GGUF (rtn, awq, gptq) with calibration data",
                       description=DESCRIPTION)
    p.add_argument("model", help="a Hugging Face directory, a .gguf file, a store or catalog name")
    p.add_argument("-o", "--output", required=True, help="the GGUF file to write")
    p.add_argument("--method", choices=("awq", "gptq", "rtn"), default="awq")
    p.add_argument("--bits", type=int, choices=(4, 8), default=4)
    p.add_argument("--zero-point", action="store_true", help="4-bit blocks with a minimum (Q4_1) instead of Q4_0")
    p.add_argument("--calibration", default=None, metavar="FILE.jsonl",
                   help='JSON Lines of {"text": ...} or {"messages": [...]} (default: the set shipped with pagoda)')
    p.add_argument("--num-samples", type=int, default=512, help="calibration samples drawn from the file")
    p.add_argument("--max-sample-tokens", type=int, default=512, help="each sample is cut to this many tokens")
    p.add_argument("--seed", type=int, default=0, help="which samples are drawn")
    p.add_argument("--summary", default=None, metavar="FILE.json", help="also write the run's timings and errors here")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from pagoda.quantize.grid import qtype_for_bits  # deferred: loads torch
    from pagoda.quantize.quantizer import quantize_model  # deferred: loads numpy, torch

    qtype = qtype_for_bits(ns.bits, ns.zero_point)
    result = quantize_model(ns.model, ns.output, method=ns.method, qtype=qtype, calibration=ns.calibration,
                            num_samples=ns.num_samples, max_sample_tokens=ns.max_sample_tokens, seed=ns.seed)
    line = f"wrote {result.path} ({ns.method}, {qtype})"
    if result.samples:
        line += (f": {result.samples} samples, {result.tokens} tokens, calibration {result.calibration_s:.1f} s, "
                 f"quantization {result.quantize_s:.1f} s; output error {100 * result.relative_error:.3f} % "
                 f"(round to nearest: {100 * result.rtn_relative_error:.3f} %)")
    print(line, file=sys.stderr)
    if ns.summary:
        summary = {k: v for k, v in vars(result).items() if k != "layers"}
        summary["path"] = str(result.path)
        with open(ns.summary, "w") as f:
            json.dump({**summary, "layers": result.layers}, f, indent=2)
    return 0
