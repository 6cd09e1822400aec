"""Hand-written CPU kernels (pagoda/csrc), compiled with torch's C++ extension builder and cached
(under $PAGODA_HOME/kernels/<cpu>), built or loaded when an engine starts (worker.py). Where no
compiler is available the engine runs the pure-torch backend (layers/backend.py);
PAGODA_DISABLE_KERNELS=1 forces that fallback.

The kernels pick their instruction-set paths at compile time (#ifdef __AVX512VNNI__ ...), so the
build's -march decides them. By default that is -march=native: every extension this CPU has, so
block_matmul takes its widest path, which measured the fastest (benchmarks/README.md, "Matmul
kernels: peaks and every route side by side").
PAGODA_KERNEL_ISA names another level (``ISA_LEVELS``: avx512-vnni, avx-vnni, avx2, scalar),
built into a directory of its own; the tests use it to run the fallback paths on a machine that
would never take them."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import subprocess
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from pagoda import envs
from pagoda.home import pagoda_home
from pagoda.progress import progress

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent.parent / "csrc"


_SOURCES = ("paged_attention.cpp", "prefill_attention.cpp", "block_matmul.cpp", "block_gemm_tiles.cpp",
            "superblock_tiles.cpp", "half_weights.cpp", "fused_ops.cpp", "small_matmul.cpp", "decode_layers.cpp",
            "lora_delta.cpp")


_disabled: bool | None = None  # PAGODA_DISABLE_KERNELS, read once (this is called per layer per step)
_level: str | None = None  # PAGODA_KERNEL_ISA, read with it

# PAGODA_KERNEL_ISA value -> (compiler flags, the /proc/cpuinfo flags a CPU needs to run the build)
ISA_LEVELS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "native": (("-march=native",), ()),
    "avx512-vnni": (("-march=x86-64-v4", "-mavx512vnni"), ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd",
                                                           "avx512_vnni")),
    "avx-vnni": (("-march=x86-64-v3", "-mavxvnni"), ("avx2", "fma", "f16c", "avx_vnni")),
    "avx2": (("-march=x86-64-v3",), ("avx2", "fma", "f16c")),
    "scalar": (("-march=x86-64",), ()),
}


def kernel_isa_level() -> str:
    """The ISA level the kernels are built for: PAGODA_KERNEL_ISA, default ``native``. Raises
    ValueError for a name not in ``ISA_LEVELS`` or a level this CPU cannot run."""
    level = envs.PAGODA_KERNEL_ISA or "native"
    if level not in ISA_LEVELS:
        raise ValueError(f"PAGODA_KERNEL_ISA={level!r} is not one of {', '.join(ISA_LEVELS)}")
    from pagoda.platform import cpu_flags  # deferred: loads torch

    missing = [f for f in ISA_LEVELS[level][1] if f not in cpu_flags()]
    if missing and cpu_flags():
        raise ValueError(f"PAGODA_KERNEL_ISA={level}: this CPU lacks {' '.join(missing)}")
    return level


def load_cpu_kernels():
    """``torch.ops.pagoda`` with the compiled kernels, or None when they are disabled
    (PAGODA_DISABLE_KERNELS; see ``reread_environment``) or cannot be built here. Built for
    PAGODA_KERNEL_ISA's level (``kernel_isa_level``; ValueError for a bad one)."""
    global _disabled, _level
    if _disabled is None:
        level = kernel_isa_level()  # first: a bad value raises on every call, not once
        _disabled, _level = envs.PAGODA_DISABLE_KERNELS, level
    return None if _disabled else _build(_level)


def reread_environment() -> None:
    """Make the next ``load_cpu_kernels`` read PAGODA_DISABLE_KERNELS and PAGODA_KERNEL_ISA again
    (tests flip them)."""
    global _disabled, _level
    _disabled = _level = None


def _cpu_key() -> str:
    """A short name for this CPU's instruction set, so that a home directory shared by machines
    never hands one of them a build with instructions it lacks."""
    from pagoda.platform import cpu_flags  # deferred: loads torch

    flags = " ".join(sorted(cpu_flags())) or platform.processor() or platform.machine()
    return f"{platform.machine()}-{hashlib.sha256(flags.encode()).hexdigest()[:12]}"


def build_directory(level: str = "native", sources: tuple[str, ...] = _SOURCES) -> Path:
    """Where a build lives: one directory per kind of CPU (its flags' hash), per ISA level, and per
    source subset (the tests build block_matmul alone for the fallback levels)."""
    name = _cpu_key() if level == "native" else f"{_cpu_key()}-{level}"
    if tuple(sources) != _SOURCES:
        name += "-" + "+".join(Path(s).stem for s in sources)
    return pagoda_home() / "kernels" / name


_LIBRARY = "pagoda_cpu_kernels"
# Every source includes these torch headers, and parsing them is most of a small file's compile
# time (benchmarks/README.md, "Kernel build time and the test suite's length"). A build writes
# them into this file in its build directory, compiles that once into a GCC precompiled header
# (.gch) beside it, and gives the file to every source with -include (GCC then reads the .gch).
_TORCH_HEADERS = "torch_headers.h"
_TORCH_HEADERS_TEXT = "#include <ATen/ATen.h>\n#include <ATen/Parallel.h>\n#include <torch/library.h>\n"


def _library_is_current(build_dir: Path, sources: tuple[str, ...]) -> bool:
    """Whether ``build_dir`` holds a library built from these very files (its build.ninja names
    them: another checkout sharing the home compiles its own) and newer than them and the headers
    beside them (loading then compiles nothing)."""
    library, ninja = build_dir / f"{_LIBRARY}.so", build_dir / "build.ninja"
    if not library.exists() or not ninja.exists():
        return False
    commands = ninja.read_text()
    if any(str(_CSRC / name) not in commands for name in sources):
        return False
    built = library.stat().st_mtime
    paths = [_CSRC / name for name in sources] + [path for path in _CSRC.iterdir() if path.suffix == ".h"]
    return all(path.stat().st_mtime <= built for path in paths)


def _precompile_torch_headers(header: Path, cflags: list[str]) -> Path | None:
    """Write ``header`` (only when its text changed: ninja would otherwise see it as new) and
    compile it to ``header.gch`` with the flags torch's extension builder gives every source, so
    GCC reads the parsed headers instead of parsing them again for each file. Returns the .gch,
    or None where it could not be made: the build then parses the text header, as it would
    anyway where a compiler finds the .gch unusable (other flags, clang)."""
    from torch.utils.cpp_extension import get_cxx_compiler, include_paths  # torch.utils loads on first use

    if not header.exists() or header.read_text() != _TORCH_HEADERS_TEXT:
        header.write_text(_TORCH_HEADERS_TEXT)
    includes = [*include_paths("cpu"), sysconfig.get_path("include", scheme="posix_prefix")]
    precompiled = header.with_name(header.name + ".gch")
    partial = header.with_name(f"{header.name}.gch.{os.getpid()}")  # renamed when whole: another build may read it
    command = [get_cxx_compiler(), f"-DTORCH_EXTENSION_NAME={_LIBRARY}", "-DTORCH_API_INCLUDE_EXTENSION_H",
               *(arg for path in includes for arg in ("-isystem", path)), "-fPIC", "-std=c++20", *cflags,
               "-x", "c++-header", str(header), "-o", str(partial)]
    try:
        subprocess.run(command, check=True, capture_output=True)
        partial.replace(precompiled)
    except (OSError, subprocess.CalledProcessError) as e:
        logger.info("could not precompile torch's headers (%s); the kernels build without", e)
        partial.unlink(missing_ok=True)
        return None
    return precompiled


def build_kernels(level: str = "native", sources: tuple[str, ...] = _SOURCES):
    """Compile (or load from its cache) ``sources`` for ISA ``level`` into this process; returns
    ``torch.ops.pagoda``. One build per process: the ops register under one name."""
    from torch.utils.cpp_extension import load  # torch.utils loads on first use

    build_dir = build_directory(level, sources)
    build_dir.mkdir(parents=True, exist_ok=True)
    cflags = ["-O3", *ISA_LEVELS[level][0], "-fopenmp", "-ffp-contract=off"]
    header = build_dir.resolve() / _TORCH_HEADERS  # one path (so one ninja command) through any link to the home
    with _build_lock(build_dir):
        precompiled = None
        if not _library_is_current(build_dir, sources):
            precompiled = _precompile_torch_headers(header, cflags)
        try:
            load(
                name=_LIBRARY,
                sources=[str(_CSRC / name) for name in sources],
                extra_cflags=[*cflags, "-include", str(header)],
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                verbose=False,
                is_python_module=False,  # registers torch.ops.pagoda.*
            )
        finally:
            if precompiled is not None:
                precompiled.unlink(missing_ok=True)  # ~400 MB, only needed while compiling
    import torch  # torch loads on first use

    return torch.ops.pagoda


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """One build or load of a kernel directory at a time, across processes.

    torch's extension loader guards a build with a `lock` file that only its own release
    removes: a build killed mid-way (Ctrl-C during a first start) left it behind, and every later
    start waited on it forever, silently. An flock is released by the kernel when its holder dies,
    so under it a `lock` file can only be such a leftover, and is removed."""
    with open(build_dir / "pagoda.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.cache
def _build(level: str):
    # Announced here, where every first build passes (the engine's start, `--dtype auto`'s
    # measurement, a script's first linear), so a minute of compiling never looks like a hang.
    building = not _library_is_current(build_directory(level), _SOURCES)
    if building:
        logger.warning("building pagoda's CPU kernels for this CPU (once; about a minute)...")
    try:
        with progress("still building the CPU kernels") if building else contextlib.nullcontext():
            ops = build_kernels(level)
    except Exception as e:  # no compiler, no ninja, ...
        logger.warning("CPU kernels unavailable (%s); using the pure-torch paths", e)
        return None
    try:
        _register_fakes()
    except Exception as e:  # the eager ops still work; only --compile would miss them
        logger.warning("could not register fake kernels for torch.compile (%s)", e)
    return ops


def _register_fakes() -> None:
    """Shape-only versions of the ops, so torch.compile (--compile) can trace through them."""
    import torch  # torch loads on first use

    @torch.library.register_fake("pagoda::block_matmul")
    def _(x, weight, block_type, packed=None):
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake("pagoda::superblock_gemm")
    def _(x, packed, out_features):
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("pagoda::half_gemm")
    def _(x, packed, out_features):
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("pagoda::paged_decode_attention")
    def _(q, k_cache, v_cache, block_tables, seq_lens, scale, window=0, k_scales=None, v_scales=None):
        return torch.empty_like(q)

    @torch.library.register_fake("pagoda::paged_prefill_attention")
    def _(q, k_cache, v_cache, block_table, start, scale, window=0, k_scales=None, v_scales=None):
        return torch.empty_like(q)


# The instruction-set extensions the kernels' source picks paths for (#ifdef __AVX512F__ ...),
# in the order they are reported.
_ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni",
              "amx_tile", "amx_int8", "amx_bf16")


def kernel_isa() -> str:
    """Which build the kernels are (PAGODA_KERNEL_ISA level, this CPU's extensions) and, once
    they are loaded, which instruction set block_matmul's integer dot products run on."""
    from pagoda.platform import cpu_flags  # deferred: loads torch

    level = kernel_isa_level()
    found = " ".join(f for f in _ISA_FLAGS if f in cpu_flags()) or "baseline"
    description = f"{platform.machine()}, {level} ({' '.join(ISA_LEVELS[level][0])}), CPU: {found}"
    ops = load_cpu_kernels()
    if ops is not None:
        min_rows, dtype = ops.block_matmul_gemm()
        description += f"; block_matmul: {ops.block_matmul_isa()}, from {min_rows} rows a {dtype} GEMM"
    return description


def kernels_are_built() -> bool:
    """Whether this CPU's kernel library exists and is newer than every source (then loading it
    takes a second; otherwise the first load compiles, about a minute)."""
    return _library_is_current(build_directory(kernel_isa_level()), _SOURCES)
