"""The machine's measured peak per instruction set, and every matmul we could route a projection
through, side by side: GOP/s and the fraction of the matching peak.

    python benchmarks/matmul_kernels.py                        # writes results/matmul-kernels-<date>.json
    python benchmarks/matmul_kernels.py --isa native,avx2      # block_matmul of several kernel builds
    python benchmarks/matmul_kernels.py --ms 64 --shapes gate_up --budget 0.5

Peaks: register-only loops of one instruction (isa_peak.c: fp32 FMA, AVX512-VNNI, AVX-VNNI, AVX2
maddubs) and the libraries at a large square size (MKL sgemm, oneDNN bf16 (AMX on this CPU),
``torch._int_mm`` int8). Shapes: SmolLM2-135M's projections ([N, K] = out x in: merged qkv, o,
merged gate/up, down) and one ~1B-model projection (8192 x 2048). For each M, the methods:

- ``block Q4_0`` / ``block Q8_0``: ``torch.ops.pagoda.block_matmul`` as the engine calls it;
  ``... int`` the same under batch invariance (the integer kernel at every M), shown where the
  two differ;
- ``fp32``: ``F.linear`` (MKL); ``bf16``: ``F.linear`` on bf16 copies (oneDNN), timed with the
  cast of x to bf16 and of y back to fp32, as a drop-in for an fp32 layer would run;
- ``int_mm``: ``torch._int_mm`` with per-row int8 activations (quantized inside the timing) and a
  per-column int8 weight, scaled back to fp32;
- ``fbgemm``: ``torch.ao.nn.quantized.dynamic.Linear`` (fbgemm's dynamic int8 linear, per-tensor
  weight scale; quantizes x itself).

Each cell is the best (shortest) of as many calls as fit in ``--budget`` seconds (at least 3):
on this shared machine other work only ever adds time, so the minimum is the least noisy
estimate of what the kernel itself costs. GOP = 2 M N K / 1e9 (one multiply and one add per
weight per row). ``--isa LEVEL`` runs the block_matmul cells of another kernel build
(PAGODA_KERNEL_ISA, see pagoda/layers/cpu_kernels.py) in a subprocess of its own (two builds
cannot be loaded in one process), in the same run.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))  # this tree's pagoda, not whichever one is installed
SHAPES = {  # name -> (N, K): out_features x in_features
    "qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),  # SmolLM2-135M
    "1b_up": (8192, 2048),  # a ~1B model's MLP projection (Llama-3.2-1B's gate / up)
}
Q4_0, Q8_0 = 2, 8
PEAK_LOOPS = {  # isa_peak.c function -> OP per call per iteration per thread
    "fma512 (fp32 FMA, AVX-512)": ("fma512", 12 * 32),
    "fma256 (fp32 FMA, AVX2)": ("fma256", 12 * 16),
    "vnni512 (int8, AVX512-VNNI)": ("vnni512", 12 * 128),
    "avx_vnni256 (int8, AVX-VNNI)": ("avx_vnni256", 12 * 64),
    "avx2_maddubs256 (int8, AVX2)": ("avx2_maddubs256", 12 * 64),
    "avx2_maddubs_i16_256 (int8, AVX2, int16 sums)": ("avx2_maddubs_i16_256", 12 * 64),
    "amx_bf16 (bf16 tiles, AMX)": ("amx_bf16", 4 * 16 * 16 * 32 * 2),
}


def best_seconds(fn, budget: float, *args) -> float:
    """The shortest of as many calls ``fn(*args)`` as fit in ``budget`` seconds (at least 3, after
    one warm-up)."""
    fn(*args)
    times: list[float] = []
    deadline = time.perf_counter() + budget
    while len(times) < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return min(times)


def random_blocks(n: int, k: int, block_type: int, generator: torch.Generator) -> torch.Tensor:
    """Random ggml blocks with a sane fp16 scale (~0.01): the kernel's speed does not depend on
    the values, and random bytes cost nothing to make (quantizing 16M weights takes seconds)."""
    bb = {Q4_0: 18, Q8_0: 34}[block_type]
    w = torch.randint(0, 256, (n, k // 32, bb), dtype=torch.uint8, generator=generator)
    w[:, :, 0], w[:, :, 1] = 0x1F, 0x21  # fp16 0x211F ~ 0.0103
    if block_type == Q8_0:
        w[:, :, 2:][w[:, :, 2:] == 0x80] = 0x81  # -128 is not a Q8_0 code
    return w.reshape(n, -1)


# --- peaks -----------------------------------------------------------------------------------

def on_threads(fn, threads: int) -> None:
    """Run ``fn`` on ``threads`` Python threads at once (ctypes calls release the GIL)."""
    pool = [threading.Thread(target=fn) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()


def isa_peaks(threads: int) -> dict[str, float]:
    """GOP/s of the register-only loops (isa_peak.c), compiled here for this CPU."""
    with tempfile.TemporaryDirectory() as tmp:
        lib_path = Path(tmp) / "isa_peak.so"
        subprocess.run(["cc", "-O3", "-march=native", "-shared", "-fPIC", str(HERE / "isa_peak.c"),
                        "-o", str(lib_path)], check=True)
        lib = ctypes.CDLL(str(lib_path))
        peaks = {}
        for label, (name, ops) in PEAK_LOOPS.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_long]
            if fn(1) == -1:
                continue  # this CPU lacks it
            iters = 4_000_000
            seconds = best_seconds(on_threads, 0.5, functools.partial(fn, iters), threads)
            peaks[label] = ops * iters * threads / seconds / 1e9
    return peaks


def library_peaks(size: int, budget: float) -> dict[str, float]:
    """GOP/s of the libraries' GEMMs at size x size x size."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(size, size, generator=g), torch.randn(size, size, generator=g)
    ai, bi = (torch.randint(-127, 128, (size, size), dtype=torch.int8, generator=g) for _ in range(2))
    ab, bb = a.bfloat16(), b.bfloat16()
    ops = 2 * size**3 / 1e9
    return {
        "sgemm fp32 (MKL)": ops / best_seconds(lambda: torch.mm(a, b), budget),
        "bf16 mm (oneDNN)": ops / best_seconds(lambda: torch.mm(ab, bb), budget),
        "_int_mm int8": ops / best_seconds(lambda: torch._int_mm(ai, bi), budget),
    }


# --- the methods -----------------------------------------------------------------------------

def int_mm_linear(w: torch.Tensor):
    """x [M, K] fp32 -> y [M, N] via torch._int_mm: int8 x per row, int8 w per column (output row)."""
    w_scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127  # [N]
    w_q = torch.round(w / w_scale[:, None]).to(torch.int8).t()  # [K, N], column-major (w's rows)

    def run(x: torch.Tensor) -> torch.Tensor:
        x_scale = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
        x_q = torch.round(x / x_scale).to(torch.int8)
        return torch._int_mm(x_q, w_q).float() * x_scale * w_scale

    return run


def fbgemm_linear(w: torch.Tensor):
    torch.backends.quantized.engine = "fbgemm"
    layer = torch.ao.nn.quantized.dynamic.Linear(w.shape[1], w.shape[0], bias_=False, dtype=torch.qint8)
    scale = w.abs().max().item() / 127
    layer.set_weight_bias(torch.quantize_per_tensor(w, scale, 0, torch.qint8), None)
    return layer


def library_methods(w: torch.Tensor) -> dict:
    w_bf16 = w.bfloat16()
    fbgemm = fbgemm_linear(w)
    return {
        "fp32": lambda x: F.linear(x, w),
        "bf16": lambda x: F.linear(x.bfloat16(), w_bf16).float(),
        "int_mm": int_mm_linear(w),
        "fbgemm": fbgemm,
    }


def block_cells(shapes: list[str], ms: list[int], budget: float, threads: int) -> list[dict]:
    """block_matmul at every (shape, M), as routed and (where it differs) integer-only."""
    from pagoda.layers.backend import select_backend
    from pagoda.layers.cpu_kernels import kernel_isa, load_cpu_kernels

    torch.set_num_threads(threads)
    ops = load_cpu_kernels()
    if ops is None:
        raise SystemExit("pagoda's C++ kernels did not build here")
    backend = select_backend("cpu")
    g = torch.Generator().manual_seed(1)
    rows = []
    for shape in shapes:
        n, k = SHAPES[shape]
        for block_type, name in ((Q4_0, "Q4_0"), (Q8_0, "Q8_0")):
            w = random_blocks(n, k, block_type, g)
            for m in ms:
                x = torch.randn(m, k, generator=g)
                seconds = best_seconds(ops.block_matmul, budget, x, w, block_type)
                rows.append({"shape": shape, "N": n, "K": k, "M": m, "method": f"block {name}", "s": seconds})
                if m >= 16:  # where a routed path may leave the integer kernel
                    with backend.batch_invariant(True):
                        s_int = best_seconds(ops.block_matmul, budget, x, w, block_type)
                    rows.append({"shape": shape, "N": n, "K": k, "M": m, "method": f"block {name} int", "s": s_int})
    gemm = list(ops.block_matmul_gemm()) if hasattr(ops, "block_matmul_gemm") else [128, "fp32"]
    for row in rows:
        row["isa"], row["gemm"] = kernel_isa(), gemm
    return rows


def library_cells(shapes: list[str], ms: list[int], budget: float) -> list[dict]:
    g = torch.Generator().manual_seed(2)
    rows = []
    for shape in shapes:
        n, k = SHAPES[shape]
        methods = library_methods(torch.randn(n, k, generator=g) * 0.02)
        for m in ms:
            x = torch.randn(m, k, generator=g)
            for name, fn in methods.items():
                rows.append({"shape": shape, "N": n, "K": k, "M": m, "method": name,
                             "s": best_seconds(fn, budget, x)})
    return rows


FAMILY_OF = {"fp32": "fp32", "bf16": "bf16", "int_mm": "int8", "fbgemm": "int8"}


def family_peaks(peaks: dict[str, float]) -> dict[str, float]:
    """The machine's measured peak per arithmetic: the best of its instruction loop and its library
    GEMM (a library may use units no loop here drives: _int_mm and bf16 mm run on AMX tiles)."""
    def best(*names: str) -> float:
        return max((peaks[n] for n in names if n in peaks), default=float("nan"))

    return {"fp32": best("fma512 (fp32 FMA, AVX-512)", "sgemm fp32 (MKL)"), "bf16": best("bf16 mm (oneDNN)"),
            "int8": best("vnni512 (int8, AVX512-VNNI)", "avx_vnni256 (int8, AVX-VNNI)",
                         "avx2_maddubs256 (int8, AVX2)", "_int_mm int8")}


def family_for(row: dict) -> str:
    """Which arithmetic a cell ran: block_matmul's integer kernel is int8, its routed rows from
    its GEMM threshold run the library GEMM in its dtype (``gemm``: block_matmul_gemm())."""
    if row["method"] in FAMILY_OF:
        return FAMILY_OF[row["method"]]
    min_rows, dtype = row.get("gemm", (1 << 62, "fp32"))
    return dtype if (not row["method"].endswith(" int") and row["M"] >= min_rows) else "int8"


def table(rows: list[dict]) -> str:
    lines = ["| shape (N x K) | M | method | build | ms | GOP/s | of peak |",
             "| --- | ---: | --- | --- | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['shape']} ({r['N']} x {r['K']}) | {r['M']} | {r['method']} | {r.get('isa_level', '')} | "
                     f"{1e3 * r['s']:.3f} | {r['gops']:.1f} | {r['of_peak']:.0%} ({r['peak']}) |")
    return "\n".join(lines)


def score(rows: list[dict], peaks: dict[str, float]) -> None:
    """GOP/s and the fraction of the matching measured peak, in place."""
    families = family_peaks(peaks)
    for r in rows:
        r["gops"] = 2 * r["M"] * r["N"] * r["K"] / r["s"] / 1e9
        r["peak"] = family_for(r)
        r["of_peak"] = r["gops"] / families[r["peak"]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--ms", default="1,4,16,64,128,512")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--budget", type=float, default=0.25, help="seconds per cell (best of the calls that fit)")
    p.add_argument("--peak-size", type=int, default=2048)
    p.add_argument("--isa", default="native", help="kernel builds to compare (PAGODA_KERNEL_ISA levels)")
    p.add_argument("--no-libraries", action="store_true", help="only block_matmul (and no peaks)")
    p.add_argument("--output", default=str(HERE / "results" / f"matmul-kernels-{date.today().isoformat()}.json"))
    p.add_argument("--block-only", action="store_true", help=argparse.SUPPRESS)  # internal: one build's cells
    p.add_argument("--retable", metavar="JSON", help="recompute the fractions of a record with --peaks-from's peaks")
    p.add_argument("--peaks-from", metavar="JSON", help="with --retable: the record whose peaks to use")
    args = p.parse_args()
    if args.retable:
        record = json.loads(Path(args.retable).read_text())
        if args.peaks_from:
            record["peaks_gops"] = json.loads(Path(args.peaks_from).read_text())["peaks_gops"]
        score(record["rows"], record["peaks_gops"])
        record["family_peaks_gops"] = family_peaks(record["peaks_gops"])
        Path(args.retable).write_text(json.dumps(record, indent=1) + "\n")
        print(table(record["rows"]))
        return 0
    shapes, ms = args.shapes.split(","), [int(m) for m in args.ms.split(",")]
    torch.set_num_threads(args.threads)
    if args.block_only:
        print(json.dumps(block_cells(shapes, ms, args.budget, args.threads)))
        return 0

    from pagoda.platform import benchmark_cpu_flags, cpu_model

    load_before = os.getloadavg()
    peaks = {} if args.no_libraries else {**isa_peaks(args.threads), **library_peaks(args.peak_size, args.budget * 4)}
    for name, value in peaks.items():
        print(f"peak {name}: {value:.0f} GOP/s", flush=True)
    rows = []
    for level in args.isa.split(","):
        out = subprocess.run([sys.executable, __file__, "--block-only", "--shapes", args.shapes, "--ms", args.ms,
                              "--threads", str(args.threads), "--budget", str(args.budget)],
                             env={**os.environ, "PAGODA_KERNEL_ISA": level}, capture_output=True, text=True,
                             check=False)
        if out.returncode:
            raise SystemExit(f"block_matmul cells for {level} failed:\n{out.stderr[-3000:]}")
        rows += [{**r, "isa_level": level} for r in json.loads(out.stdout.strip().splitlines()[-1])]
    if not args.no_libraries:
        rows += library_cells(shapes, ms, args.budget)
    score(rows, peaks)
    rows.sort(key=lambda r: (list(SHAPES).index(r["shape"]), r["M"]))
    print(table(rows))
    record = {"date": date.today().isoformat(), "command": " ".join(["python", *sys.argv]), "threads": args.threads,
              "budget_s": args.budget, "cpu": cpu_model(), "cpu_flags": benchmark_cpu_flags(),
              "torch": torch.__version__, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
              "peaks_gops": peaks, "family_peaks_gops": family_peaks(peaks), "rows": rows}
    Path(args.output).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
