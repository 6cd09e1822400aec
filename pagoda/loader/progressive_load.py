"""Loading a model one decoder layer at a time on a loader thread (``EngineArgs.progressive_load``).

The whole-model load (model_loader.py) reads every weight, converts, quantizes (repacks), packs,
and only then does the engine size and allocate its KV cache and the server take requests. Here
the model is built empty, handed to the engine at once, and filled by a thread in stages: the
outer weights first (embedding, final norm, output head: a tied head is the embedding's blocks,
and the GGUF head shares its repack with it), then layer 0 .. N-1, each fully prepared (weights
copied, quantized and repacked through the repacked cache, packed) before it is marked ready
(models/layer_readiness.py). A forward pass that reaches a layer waits for its mark, so a request
that arrives while the model loads runs its prefill layer by layer as the layers arrive.

Only the Llama family's own layers (Llama, Mistral, SmolLM2, Qwen2/3) load so; what else asks for
it loads whole, with the reason logged (``refusal``): tensor parallelism (ranks load in step),
encrypted models (decrypted in one piece), other families (their own ``load_weights``, pooling
encoders, state-space, vision and mixture-of-experts models) and devices other than the CPU.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn

from pagoda import envs
from pagoda.distributed.parallel_state import TensorParallelGroup
from pagoda.heap import release_freed_memory
from pagoda.layers.backend import TorchBackend
from pagoda.layers.backend import building_with as building_backend
from pagoda.layers.packed_weights import float_packing_pays, pack_block_linears, pack_float_linears
from pagoda.layers.quantization import quantize_output_head, quantize_projections
from pagoda.loader.model_files import ModelFiles
from pagoda.loader.repacked_cache import RepackCache
from pagoda.loader.safetensors import iter_safetensors_weights
from pagoda.models.layer_readiness import LayerReadiness
from pagoda.models.llama import LlamaForCausalLM
from pagoda.platform import available_memory_bytes

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# tests: called on the loader thread with each stage's number before it loads (None: nothing), so
# that a test holds the load at a layer while a request runs into it
stage_hook: Callable[[int], None] | None = None
Reader = Callable[[Callable[[str], bool]], Iterator]  # the weights whose names a predicate accepts


def stage_of(name: str) -> int:
    """The stage that loads weight or parameter ``name``: 0 for the outer weights, i + 1 for layer i's."""
    match = _LAYER.search(name)
    return 0 if match is None else int(match.group(1)) + 1


def refusal(model_cls: type, files: ModelFiles, device: torch.device, tp: TensorParallelGroup) -> str | None:
    """Why this model loads whole rather than layer by layer, or None."""
    if tp.is_parallel:
        return "tensor parallelism: the ranks load their shards in step"
    if files.encryption is not None:
        return "an encrypted model is decrypted in one piece"
    if device.type != "cpu":
        return f"the device is {device.type}; layer-by-layer loading is measured on the CPU only"
    own = ("load_weights", "forward", "embed", "compute_logits")
    if not issubclass(model_cls, LlamaForCausalLM) or any(getattr(model_cls, f) is not getattr(LlamaForCausalLM, f)
                                                         for f in own):
        return f"{model_cls.__name__} loads or runs its weights its own way (the Llama family's layers only)"
    return None


def start(model: nn.Module, files: ModelFiles, hf_config: dict, dtype: torch.dtype, device: torch.device,
          quantization: str | None, cache: RepackCache | None, backend: TorchBackend) -> LayerReadiness:
    """Start filling ``model`` (built, its storage empty) on a loader thread; returns at once with
    ``model.loading`` set, which the thread clears once every layer is in place."""
    model.to(device=device, dtype=dtype).eval()  # the empty storage: the weights are copied into it converted
    shares = _stage_shares(model)
    readiness = LayerReadiness(len(model.layers), expected_bytes=_expected_bytes(model, files, dtype, quantization),
                               stage_shares=shares)
    model.loading = model.load_readiness = readiness  # the latter kept: the loading state for /health
    loader = _Stages(model, lambda: _reader(files, hf_config, quantization == "gguf"), quantization, cache, dtype,
                     device, backend, shares)
    # Not a daemon: an interpreter that exits while the thread is in a kernel aborts ("terminate
    # called without an active exception"), so the exit waits for the load; the engine's
    # shutdown cancels it at the next stage.
    threading.Thread(target=_run, args=(model, loader, readiness, backend), name="pagoda-loader").start()
    return readiness


def _run(model: nn.Module, loader: _Stages, readiness: LayerReadiness, backend: TorchBackend) -> None:
    # This thread leads its own OpenMP team while it repacks; it ends with the load, and libgomp
    # then lets the team go, so the engine's thread is again the only one leading a team
    # (engine/core_client.py, ThreadCoreClient).
    delay = envs.PAGODA_TEST_LAYER_LOAD_DELAY
    try:
        with building_backend(backend):
            _before(0, 0.0, readiness)
            loader.prepare(0)
            readiness.mark_outer()
            for i in range(len(model.layers)):
                _before(i + 1, delay, readiness)
                loader.prepare(i + 1)
                readiness.mark_layer(i)
        cache = loader.cache
        if cache is not None and cache.hits + cache.misses:
            logger.info("repacked weights: %d mapped as repacked at an earlier start, %d repacked now (kept in %s)",
                        cache.hits, cache.misses, cache.directory)
        release_freed_memory()  # the float weights quantization freed: glibc would keep their pages
        model.loading = None  # every event is set: a step need not check them any more
        readiness.finish()  # the model runner's choice of the fused decode stack, now every layer is in place
        logger.info("model loaded layer by layer in %.1fs", time.monotonic() - readiness.started)
    except LoadCancelled as e:
        logger.info("loading the model layer by layer stopped: the engine shut down")
        readiness.fail(e)
    except BaseException as e:  # noqa: BLE001 -- a forward pass waiting for a layer must hear of any failure
        logger.exception("loading the model layer by layer failed")
        readiness.fail(e)


class LoadCancelled(RuntimeError):
    """The engine shut down while the model loaded."""


def _before(stage: int, delay: float, readiness: LayerReadiness) -> None:
    """The tests' hold on a stage (their hook, or a delay: a load slow enough for a request sent
    to a server's process to arrive mid-way); then stop if the engine shut down."""
    if stage_hook is not None:
        stage_hook(stage)
    if delay:
        time.sleep(delay)
    if readiness.cancelled:
        raise LoadCancelled("the engine shut down while the model loaded")


class _Stages:
    """Prepares one stage of the model: its weights copied, quantized and packed."""

    def __init__(self, model: nn.Module, open_reader: Callable[[], Reader], quantization: str | None,
                 cache: RepackCache | None, dtype: torch.dtype, device: torch.device, backend: TorchBackend,
                 shares: list[float]) -> None:
        self.model, self.open_reader, self.quantization, self.cache = model, open_reader, quantization, cache
        self.read: Reader | None = None  # opened on the loader's thread (a GGUF's metadata takes a while)
        self.dtype, self.device, self.shares = dtype, device, shares
        self.ops = getattr(backend, "ops", None)
        self.float_pays: bool | None = None  # whether float32 weights get oneDNN copies (asked at the first stage)
        # what the copies may take: the memory available once the model is in (its known size
        # subtracted), shared among the stages as their parameters are
        self.available = available_memory_bytes(device) - model.loading.pending_bytes()

    def prepare(self, stage: int) -> None:
        model = self.model
        if self.read is None:
            self.read = self.open_reader()

        def expect(name: str) -> bool:
            return stage_of(name) == stage

        model.load_weights(self.read(expect), expect=expect)
        packed, model.packed_weights = model.packed_weights, {}
        if self.quantization is not None:
            if stage == 0:
                quantize_output_head(model, self.quantization, packed, cache=self.cache)
            else:
                quantize_projections(model.layers[stage - 1], self.quantization, packed, cache=self.cache,
                                     prefix=f"layers.{stage - 1}.")
        part, budget = self._part(stage), int(self.available * self.shares[stage])
        if self.quantization is not None:
            pack_block_linears(part, self.ops, budget, quiet=True)
        if self.dtype == torch.float32:
            if self.float_pays is None:  # measured or read once, logged once
                self.float_pays = float_packing_pays() if self.ops is not None else False
            pack_float_linears(part, self.ops, budget, quiet=True, pays=self.float_pays)

    def _part(self, stage: int) -> nn.Module:
        if stage > 0:
            return self.model.layers[stage - 1]
        outer = nn.Module()  # the embedding and the head, under the names the packers look for
        outer.embed_tokens = self.model.embed_tokens
        outer.lm_head = self.model.lm_head  # None when tied: the packers then take the embedding
        return outer


def _reader(files: ModelFiles, hf_config: dict, keep_quantized: bool) -> Reader:
    """The weights a predicate names, read from the files; a GGUF's metadata parsed once."""
    if files.gguf_file is not None:
        from pagoda.loader.gguf_file import read_gguf  # deferred: loads gguf
        from pagoda.loader.gguf_weights import iter_gguf_weights  # deferred: loads gguf

        gguf = read_gguf(files.gguf_file)
        return lambda only: iter_gguf_weights(gguf, hf_config, keep_quantized=keep_quantized, only=only)
    return lambda only: iter_safetensors_weights(files.metadata_dir, only=only)


def _stage_shares(model: nn.Module) -> list[float]:
    """Each stage's part of the model's parameters (stage 0: the outer weights)."""
    counts = [0] * (len(model.layers) + 1)
    for name, param in model.named_parameters():
        counts[stage_of(name)] += param.numel()
    total = sum(counts) or 1
    return [c / total for c in counts]


def _expected_bytes(model: nn.Module, files: ModelFiles, dtype: torch.dtype, quantization: str | None) -> int:
    """The model's size once loaded, known before it is: a GGUF's file under ``gguf`` (its blocks are
    kept), the parameters at ``dtype``'s size otherwise (an upper bound for int8 / int4)."""
    if quantization == "gguf" and files.gguf_file is not None:
        return files.gguf_file.stat().st_size
    return sum(p.numel() for p in model.parameters()) * torch.empty((), dtype=dtype).element_size()
