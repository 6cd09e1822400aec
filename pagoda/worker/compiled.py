"""The model's forward under torch.compile, for `compile=True` / `--compile`.

Attention stays eager (`PagedAttention.forward` is excluded from tracing): it reads the step's
block tables and loops over prefill chunks in Python. Dynamo compiles the pieces between the
attention calls (projections, norms, rotary, MLP) with dynamic shapes, so batches of any size
reuse one compilation. Inductor's caches live under `$PAGODA_HOME/inductor`, so a second start
loads the compiled kernels instead of building them again.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import torch

from pagoda.home import pagoda_home
from pagoda.layers.attention import PagedAttention

logger = logging.getLogger(__name__)


def compiled_forward(model: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # torch._inductor loads on first use


    # torch writes its default into the environment on first use, so "unset or torch's default"
    # means the user chose nothing.
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, os.path.abspath(default_cache_dir())):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(pagoda_home() / "inductor")
    _keep_attention_eager()
    logger.info("compiling the model with torch.compile (dynamic shapes); the first steps are slow")
    return torch.compile(model.forward, dynamic=True)


def _keep_attention_eager() -> None:
    """Exclude `PagedAttention.forward` from tracing (once a process). Done here rather than with
    a decorator on the method, which would import torch._dynamo in every process that loads a model."""
    if not getattr(PagedAttention.forward, "_pagoda_eager", False):
        PagedAttention.forward = torch.compiler.disable(PagedAttention.forward)
        PagedAttention.forward._pagoda_eager = True
