"""Hand-written CPU kernels (pagoda/csrc), compiled with torch's C++ extension builder and cached
(under $PAGODA_HOME/kernels/<cpu>), built or loaded when an engine starts (worker.py). Where no
compiler is available the engine runs the pure-torch backend (layers/backend.py);
PAGODA_DISABLE_KERNELS=1 forces that fallback."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent.parent / "csrc"


_SOURCES = ("paged_attention.cpp", "block_matmul.cpp", "fused_ops.cpp", "small_matmul.cpp", "decode_layers.cpp")


_disabled: bool | None = None  # PAGODA_DISABLE_KERNELS, read once (this is called per layer per step)


def load_cpu_kernels():
    """``torch.ops.pagoda`` with the compiled kernels, or None when they are disabled
    (PAGODA_DISABLE_KERNELS; see ``reread_environment``) or cannot be built here."""
    global _disabled
    if _disabled is None:
        _disabled = os.environ.get("PAGODA_DISABLE_KERNELS", "") not in ("", "0")
    return None if _disabled else _build()


def reread_environment() -> None:
    """Make the next ``load_cpu_kernels`` read PAGODA_DISABLE_KERNELS again (tests flip it)."""
    global _disabled
    _disabled = None


def _cpu_key() -> str:
    """A short name for this CPU's instruction set, so that a home directory shared by machines
    never hands one of them a build with instructions it lacks."""
    import hashlib
    import platform

    from pagoda.platform import cpu_flags

    flags = " ".join(sorted(cpu_flags())) or platform.processor() or platform.machine()
    return f"{platform.machine()}-{hashlib.sha256(flags.encode()).hexdigest()[:12]}"


@functools.cache
def _build():
    try:
        from torch.utils.cpp_extension import load

        from pagoda.home import pagoda_home

        build_dir = pagoda_home() / "kernels" / _cpu_key()  # -march=native: one build per kind of CPU
        build_dir.mkdir(parents=True, exist_ok=True)
        load(
            name="pagoda_cpu_kernels",
            sources=[str(_CSRC / name) for name in _SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
            is_python_module=False,  # registers torch.ops.pagoda.*
        )
        import torch

        try:
            _register_fakes()
        except Exception as e:  # the eager ops still work; only --compile would miss them
            logger.warning("could not register fake kernels for torch.compile (%s)", e)

        return torch.ops.pagoda
    except Exception as e:  # no compiler, no ninja, ...
        logger.warning("CPU kernels unavailable (%s); using the pure-torch paths", e)
        return None


def _register_fakes() -> None:
    """Shape-only versions of the ops, so torch.compile (--compile) can trace through them."""
    import torch

    @torch.library.register_fake("pagoda::block_matmul")
    def _(x, weight, block_type):
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake("pagoda::paged_decode_attention")
    def _(q, k_cache, v_cache, block_tables, seq_lens, scale, window=0):
        return torch.empty_like(q)


# The instruction-set extensions the kernels' source picks paths for (#ifdef __AVX512F__ ...),
# in the order they are reported.
_ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni",
              "amx_tile", "amx_int8", "amx_bf16")


def kernel_isa() -> str:
    """Which of this CPU's extensions the kernels are built with (-march=native)."""
    import platform

    from pagoda.platform import cpu_flags

    flags = cpu_flags()
    found = [f for f in _ISA_FLAGS if f in flags]
    return f"{platform.machine()}, -march=native: {' '.join(found) or 'baseline'}"


def kernels_are_built() -> bool:
    """Whether this CPU's kernel library exists and is newer than every source (then loading it
    takes a second; otherwise the first load compiles, about a minute)."""
    from pagoda.home import pagoda_home

    library = pagoda_home() / "kernels" / _cpu_key() / "pagoda_cpu_kernels.so"
    if not library.exists():
        return False
    built = library.stat().st_mtime
    return all(path.stat().st_mtime <= built for path in _CSRC.iterdir() if path.suffix in (".cpp", ".h"))
