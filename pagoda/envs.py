"""Every environment variable pagoda reads, each with what it does, in one place (as vLLM's envs.py).

    from pagoda import envs
    envs.PAGODA_HOME            # read from the environment at each access, so a test or a parent
                                # process that sets a variable is seen

Variables set by pagoda itself for its child processes are listed at the end. Secrets (keys,
passwords) come from the environment so that they never show in `ps`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _text(name: str, default: str = "") -> Callable[[], str]:
    return lambda: os.environ.get(name, default).strip()


def _secret(name: str) -> Callable[[], str | None]:
    return lambda: os.environ.get(name) or None


def _on_unless_zero(name: str) -> Callable[[], bool]:
    return lambda: os.environ.get(name, "1") != "0"


def _off_unless_set(name: str) -> Callable[[], bool]:
    return lambda: os.environ.get(name, "") not in ("", "0")


def _home() -> Path:
    return Path(os.environ.get("PAGODA_HOME") or Path.home() / ".cache" / "pagoda").expanduser()


VARIABLES: dict[str, Callable[[], Any]] = {
    # -- where things live ----------------------------------------------------------------------
    # models, converted GGUF metadata, built kernels, repacked weights, the store (~/.cache/pagoda)
    "PAGODA_HOME": _home,
    # -- the device and its kernels -------------------------------------------------------------
    # "cpu": run on the CPU even where CUDA is available
    "PAGODA_DEVICE": _text("PAGODA_DEVICE"),
    # the CPU kernels' instruction-set level (native, avx512-vnni, avx2, scalar; layers/cpu_kernels.py)
    "PAGODA_KERNEL_ISA": _text("PAGODA_KERNEL_ISA"),
    # 1: no C++ kernels, every layer in plain torch (as on a machine without a compiler)
    "PAGODA_DISABLE_KERNELS": _off_unless_set("PAGODA_DISABLE_KERNELS"),
    # 0: weights are not packed at load for the many-row GEMMs (layers/packed_weights.py)
    "PAGODA_PACK_WEIGHTS": _on_unless_zero("PAGODA_PACK_WEIGHTS"),
    # the packed copy of ggml blocks: tiles, bf16 or none (layers/packed_weights.py; default: measured)
    "PAGODA_BLOCK_PACKING": _text("PAGODA_BLOCK_PACKING"),
    # tests only: seconds the progressive loader waits before each decoder layer, so that a request
    # arrives while the model loads (loader/progressive_load.py); never needed for correctness
    "PAGODA_TEST_LAYER_LOAD_DELAY": lambda: float(os.environ.get("PAGODA_TEST_LAYER_LOAD_DELAY") or 0),
    # 0: repacked weights are not cached on disk between starts (loader/repacked_cache.py)
    "PAGODA_REPACK_CACHE": _on_unless_zero("PAGODA_REPACK_CACHE"),
    # 0: glibc may hand freed memory back to the system between steps (heap.py)
    "PAGODA_KEEP_FREED_MEMORY": _on_unless_zero("PAGODA_KEEP_FREED_MEMORY"),
    # a vision tower's attention in chunks of this many query patches (models/siglip.py; empty: all
    # at once): less memory where attention holds every score; see benchmarks/README.md
    "PAGODA_VISION_ATTENTION_CHUNK": _text("PAGODA_VISION_ATTENTION_CHUNK"),
    # -- tensor parallelism ---------------------------------------------------------------------
    # 0: ranks on one node exchange through gloo, not shared memory (to compare; worker/worker.py)
    "PAGODA_TP_SHARED_MEMORY": _on_unless_zero("PAGODA_TP_SHARED_MEMORY"),
    # fork or spawn for the ranks' processes (executor/start_method.py; default: fork where safe)
    "PAGODA_WORKER_MULTIPROC_METHOD": _text("PAGODA_WORKER_MULTIPROC_METHOD"),
    # -- secrets --------------------------------------------------------------------------------
    # the key of encrypted models, when no --model-key-file (loader/model_keys.py)
    "PAGODA_MODEL_KEY": _secret("PAGODA_MODEL_KEY"),
    # the server's API key, when no --api-key
    "PAGODA_API_KEY": _secret("PAGODA_API_KEY"),
    # the router's admin key, when no --admin-key (router/options.py)
    "PAGODA_ROUTER_ADMIN_KEY": _secret("PAGODA_ROUTER_ADMIN_KEY"),
    # the password of --ssl-keyfile (security/tls.py)
    "PAGODA_SSL_KEYFILE_PASSWORD": _secret("PAGODA_SSL_KEYFILE_PASSWORD"),
    # an OCI registry's credentials for push / pull, and the host they are for (store/oci_http.py)
    "PAGODA_REGISTRY_USERNAME": _secret("PAGODA_REGISTRY_USERNAME"),
    "PAGODA_REGISTRY_PASSWORD": _secret("PAGODA_REGISTRY_PASSWORD"),
    "PAGODA_REGISTRY_HOST": _secret("PAGODA_REGISTRY_HOST"),
    # -- set by pagoda for its own children -----------------------------------------------------
    # a --data-parallel-size replica's parent process id: the replica exits with it (router/data_parallel.py)
    "PAGODA_DP_PARENT": _text("PAGODA_DP_PARENT"),
    # why the OpenMP spin count was chosen, for the start-up line of each process (threads.py)
    "PAGODA_OPENMP_SPIN_REASON": _text("PAGODA_OPENMP_SPIN_REASON"),
}


def __getattr__(name: str) -> Any:
    if name in VARIABLES:
        return VARIABLES[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(VARIABLES)
