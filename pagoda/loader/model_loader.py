"""Builds the model for an architecture and fills it with weights in the requested dtype."""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagoda.distributed.parallel_state import SINGLE, TensorParallelGroup
from pagoda.distributed.parallel_state import building_with as building_tp
from pagoda.layers.backend import TorchBackend, current_backend, select_backend
from pagoda.layers.backend import building_with as building_backend
from pagoda.layers.packed_weights import pack_block_linears, pack_float_linears
from pagoda.layers.quantization import check_quantization, quantize_linears
from pagoda.layers.rotary import RotaryEmbedding
from pagoda.loader import progressive_load
from pagoda.loader.encrypted_model import open_encrypted_weights
from pagoda.loader.repacked_cache import RepackCache, cache_directory
from pagoda.loader.model_files import ModelFiles
from pagoda.loader.safetensors import iter_safetensors_weights
from pagoda.models.model_classes import resolve_architecture
from pagoda.heap import release_freed_memory
from pagoda.platform import available_memory_bytes

logger = logging.getLogger(__name__)

def load_model(files: ModelFiles, hf_config: dict, dtype: torch.dtype, device: torch.device, max_position: int,
               quantization: str | None = None, tp: TensorParallelGroup = SINGLE,
               backend: TorchBackend | None = None, progressive: bool = False) -> nn.Module:
    """``quantization``: None, "int8", "int4" or "gguf" (``ModelConfig.quantization``).
    ``tp``: the model's tensor-parallel group; the model is built for this rank's shard and only
    that shard is read from the files (``model.weight_slice``). ``backend``: the kernels its layers
    run (default: ``select_backend(device)``). ``progressive``: return the model at once and load it
    layer by layer on a thread (loader/progressive_load.py; ``model.loading`` says how far it is),
    where the model allows; otherwise, with the reason logged, whole."""
    backend = backend or select_backend(device)
    with building_backend(backend):
        return _load(files, hf_config, dtype, device, max_position, quantization, tp, backend, progressive)


def _load(files: ModelFiles, hf_config: dict, dtype: torch.dtype, device: torch.device, max_position: int,
          quantization: str | None, tp: TensorParallelGroup, backend: TorchBackend, progressive: bool) -> nn.Module:
    quantization = check_quantization(quantization)
    if quantization == "gguf" and files.format != "gguf":
        raise ValueError(f"quantization='gguf' keeps a GGUF's own quantized weights, but {files.name!r} is not a GGUF")
    _, model_cls = resolve_architecture(hf_config)
    with torch.device("meta"), building_tp(tp):
        model = model_cls(hf_config, max_position)
    _materialize_on_cpu(model)
    _init_buffers(model)
    if progressive:
        refused = progressive_load.refusal(model_cls, files, device, tp)
        if refused is None:
            progressive_load.start(model, files, hf_config, dtype, device, quantization, _repack_cache(files, tp),
                                   backend)
            return model
        logger.info("progressive loading off: %s; the model loads whole", refused)
    narrow = model.weight_slice if tp.is_parallel else None
    model.load_weights(_weights(files, hf_config, keep_quantized=quantization == "gguf", narrow=narrow))
    model = model.to(device=device, dtype=dtype).eval()
    if quantization is not None:
        packed = getattr(model, "packed_weights", None)
        cache = _repack_cache(files, tp)
        count = quantize_linears(model, quantization, packed, cache=cache)
        model.packed_weights = {}  # drop the stored blocks (views of the mapped file)
        logger.info("quantization=%s: %d projection layers quantized", quantization, count)
        if cache is not None and cache.hits + cache.misses:
            logger.info("repacked weights: %d mapped as repacked at an earlier start, %d repacked now (kept in %s)",
                        cache.hits, cache.misses, cache.directory)
        release_freed_memory()  # the float weights quantization freed: glibc would keep their pages
        if device.type == "cpu":
            pack_block_linears(model, getattr(current_backend(), "ops", None), available_memory_bytes(device))
    if device.type == "cpu" and dtype == torch.float32:
        pack_float_linears(model, getattr(current_backend(), "ops", None), available_memory_bytes(device))
    return model


def _repack_cache(files: ModelFiles, tp: TensorParallelGroup) -> RepackCache | None:
    """Where a GGUF's repacked weights are kept between starts; none for an encrypted model (its
    weights never reach the disk decrypted)."""
    if files.gguf_file is None or files.encryption is not None:
        return None
    directory = cache_directory(files.gguf_file, tp.rank, tp.world_size)
    return RepackCache(directory) if directory is not None else None


def _materialize_on_cpu(model: nn.Module) -> None:
    """Give the meta-device model uninitialized CPU storage, as ``to_empty`` does, but through
    ``torch.empty``: ``to_empty``'s ``empty_like`` of a meta tensor runs torch's Python reference
    implementation, which imports sympy and torch.fx's symbolic shapes (~0.5 s of every start). A
    parameter or buffer that several modules share stays shared."""
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(meta) -> (meta, kept alive so ids stay unique; cpu)
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in made:
                made[id(param)] = (param, nn.Parameter(torch.empty(param.shape, dtype=param.dtype),
                                                       requires_grad=param.requires_grad))
            setattr(module, name, made[id(param)][1])
        for name, buffer in list(module.named_buffers(recurse=False)):
            if id(buffer) not in made:
                made[id(buffer)] = (buffer, torch.empty(buffer.shape, dtype=buffer.dtype))
            setattr(module, name, made[id(buffer)][1])  # stays (non-)persistent


def _init_buffers(model: nn.Module) -> None:
    """Non-persistent buffers (rotary tables) are computed, not loaded: rebuild them on CPU."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_cache()


def _weights(files: ModelFiles, hf_config: dict, keep_quantized: bool = False, narrow=None):
    if files.encryption is not None:  # decrypted into memory, never to disk (pagoda/loader/encrypted_model.py)

        return open_encrypted_weights(files, hf_config, keep_quantized=keep_quantized, narrow=narrow)
    if files.gguf_file is not None:
        from pagoda.loader.gguf_weights import iter_gguf_weights  # deferred: loads gguf

        return iter_gguf_weights(files.gguf_file, hf_config, keep_quantized=keep_quantized, narrow=narrow)

    return iter_safetensors_weights(files.metadata_dir, narrow=narrow)
