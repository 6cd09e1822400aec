"""A worker's loaded LoRA adapters, and the step's ``LoRABatch`` built from its rows' adapters.

The scheduler says what to load and drop (``SchedulerOutput.lora_loads`` / ``lora_unloads``,
core/lora_residency.py); each rank reads the adapter's files itself and keeps its own cut of
every pair (lora/binding.py), as it does with the base weights.
"""

from __future__ import annotations

import logging
import time

import numpy as np
from torch import nn

from pagoda.core.scheduler_output import SchedulerOutput
from pagoda.layers.lora_delta import AdapterDeltas, LoRABatch
from pagoda.lora.binding import adapter_nbytes, bind_adapter, label_projections
from pagoda.lora.config import LoRAConfig
from pagoda.lora.adapter_files import read_adapter

logger = logging.getLogger(__name__)


class LoRAWeights:
    def __init__(self, model: nn.Module, config: LoRAConfig, hf_config: dict) -> None:
        self.model, self.config, self.hf_config = model, config, hf_config
        self.adapters: dict[int, AdapterDeltas] = {}  # adapter id → its deltas on this rank
        label_projections(model)

    def apply(self, sched: SchedulerOutput) -> None:
        for lora_id in sched.lora_unloads:
            self.adapters.pop(lora_id, None)
        for lora in sched.lora_loads:
            started = time.perf_counter()
            adapter = read_adapter(lora.lora_path, self.hf_config, self.config.max_lora_rank)
            deltas = self.adapters[lora.lora_int_id] = bind_adapter(self.model, adapter, self.config.dtype)
            logger.info("LoRA adapter %r (id %d, rank %d) loaded in %.1f ms, %.2f MiB", lora.lora_name,
                        lora.lora_int_id, adapter.rank, (time.perf_counter() - started) * 1e3,
                        adapter_nbytes(deltas) / 2**20)

    def batch_for(self, token_adapters: np.ndarray) -> LoRABatch | None:
        """The step's adapters and their flat rows (``token_adapters``: each token's adapter id);
        None when every row runs on the base model."""
        return LoRABatch(self.adapters, token_adapters) if token_adapters.any() else None
