"""`pagoda quantize`: a model's projections quantized by rtn, awq or gptq, written as a GGUF.

1. The model loads in float32 through pagoda's own engine (any `--model` form: a Hugging Face
   directory, a GGUF, which is dequantized, a store or catalog name).
2. awq / gptq calibrate layer by layer (layerwise.py): the samples' hidden states go through
   layer i with layers < i already quantized, layer i's projections record their inputs
   (statistics.py), layer i is quantized, and its quantized output is layer i + 1's input.
3. Each decoder layer's projections (merged q/k/v, o, merged gate/up, down) are quantized to the
   chosen block type: rtn.py, awq.py (scales folded into the norms, v and up rows first) or
   gptq.py. The embedding (and an untied output head) are Q8_0 by round to nearest, as pagoda's
   int4 mode and most llama.cpp 4-bit files keep them; norms and biases stay float32.
4. loader/gguf_writer.py writes the GGUF: llama.cpp's names and metadata, the tokenizer, and
   the blocks exactly as chosen.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from pagoda import LLM
from pagoda.layers.packed_weights import drop_packed_copies
from pagoda.loader.gguf_writer import write_gguf
from pagoda.loader.gguf_writer_tensors import BlockTensor
from pagoda.quantize import awq, grid
from pagoda.quantize.calibration import load_samples
from pagoda.quantize.gptq import gptq
from pagoda.quantize.layerwise import LayerInputs, LayerRunner
from pagoda.quantize.rtn import rtn_blocks
from pagoda.quantize.statistics import InputStatistics

logger = logging.getLogger(__name__)

METHODS = ("rtn", "awq", "gptq")
EMBEDDING_QTYPE = "Q8_0"
# Per method: whether layer i + 1's inputs are layer i's output as quantized (True) or as float
# (False: every layer's statistics are those of the float model). Measured on SmolLM2 Q4_0
# (benchmarks/README.md, "Calibrated quantization"): awq +18.9 % perplexity sequential; gptq
# +42.1 % one pass against +48.1 % sequential.
SEQUENTIAL = {"awq": True, "gptq": False}
# AWQ's scale searches for qkv and gate/up run the attention / MLP block on the samples of
# this many chunks (layerwise.CHUNK_TOKENS, 4,096 tokens, each); o's, down's and the clipping
# searches use every token through the statistics
AWQ_SEARCH_CHUNKS = 1


@dataclass
class QuantizeResult:
    """What a run did, for the command's summary and the benchmark."""

    path: Path
    method: str
    qtype: str
    samples: int = 0
    tokens: int = 0
    load_s: float = 0.0
    calibration_s: float = 0.0  # running the samples through the model
    quantize_s: float = 0.0  # the method itself
    write_s: float = 0.0
    # summed output error of every projection over the calibration tokens, relative to the
    # output's own size: this method's, and round to nearest's on the same statistics
    relative_error: float | None = None
    rtn_relative_error: float | None = None
    layers: list[dict] = field(default_factory=list)


@dataclass
class _Layer:
    """One decoder layer's parameter names and sizes (pagoda's merged names)."""

    prefix: str
    attn_norm: str
    mlp_norm: str
    q_size: int
    kv_size: int
    head_dim: int
    heads_per_kv: int
    intermediate: int
    qkv_bias: bool

    def name(self, part: str) -> str:
        return f"{self.prefix}.{part}"


# dense decoders whose layers quantize_projections knows (merged qkv / gate_up, one norm before each)
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Gemma3ForCausalLM")


def check_architecture(architecture: str) -> None:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"pagoda quantize does not handle {architecture} yet: it quantizes the dense "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def _layers(model: torch.nn.Module) -> list[_Layer]:
    out = []
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        mlp_norm = "pre_feedforward_layernorm" if hasattr(layer, "pre_feedforward_layernorm") else "post_attention_layernorm"
        out.append(_Layer(f"layers.{i}", f"layers.{i}.input_layernorm.weight", f"layers.{i}.{mlp_norm}.weight",
                          attn.q_size, attn.kv_size, attn.head_dim, attn.num_heads // attn.num_kv_heads,
                          mlp.intermediate_size, attn.qkv_proj.bias is not None))
    return out


PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def _rtn_approx(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    import gguf  # deferred: gguf loads on first use

    blocks = rtn_blocks(weight, qtype)
    return torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype]).copy())


def _block_error(param: torch.nn.Parameter, output: Callable[[], torch.Tensor]) -> Callable[[torch.Tensor], float]:
    """A function of a candidate weight: the summed squared change of ``output()`` (a block of the
    model run on captured inputs) when ``param`` holds that candidate instead of its own value."""
    original = param.detach().clone()
    reference = output()

    def error(candidate: torch.Tensor) -> float:
        param.data.copy_(candidate)
        try:
            return float(((output() - reference) ** 2).sum())
        finally:
            param.data.copy_(original)

    return error


def _awq_layer(state: dict[str, torch.Tensor], layer: _Layer, inputs: LayerInputs, qtype: str,
               block_errors: dict[str, Callable[[torch.Tensor], float]] | None = None
               ) -> dict[str, tuple[grid.Quantized, torch.Tensor]]:
    """AWQ on one layer: scales searched and folded into ``state`` (norms, v and up rows), then
    each projection quantized with the clipping search. ``block_errors``: by weight name, the
    error on the output of the block (attention, MLP) the scale search of that weight measures.
    Returns name → (codes, hessian of its scaled inputs)."""
    stats = inputs.stats
    block_errors = block_errors or {}
    qkv, o = layer.name("self_attn.qkv_proj.weight"), layer.name("self_attn.o_proj.weight")
    gate_up, down = layer.name("mlp.gate_up_proj.weight"), layer.name("mlp.down_proj.weight")
    hessians = {w: stats[w.removesuffix(".weight")].mean_hessian() for w in (qkv, o, gate_up, down)}

    def scale_inputs(weight_name: str, tie: torch.Tensor | None = None) -> torch.Tensor:
        s = awq.search_scales(state[weight_name], hessians[weight_name],
                              stats[weight_name.removesuffix(".weight")].mean_abs(), qtype, tie,
                              block_errors.get(weight_name))
        state[weight_name] = state[weight_name] * s
        hessians[weight_name] = hessians[weight_name] / torch.outer(s, s)
        return s

    state[layer.attn_norm] = state[layer.attn_norm] / scale_inputs(qkv)
    # o's inputs are the attention's v outputs: one v channel serves heads_per_kv query heads
    channel = torch.arange(layer.q_size)
    tie = (channel // layer.head_dim // layer.heads_per_kv) * layer.head_dim + channel % layer.head_dim
    s_o = scale_inputs(o, tie)
    s_v = torch.zeros(layer.kv_size).index_copy_(0, tie, s_o)
    v_rows = slice(layer.q_size + layer.kv_size, layer.q_size + 2 * layer.kv_size)
    state[qkv][v_rows] /= s_v[:, None]
    if layer.qkv_bias:
        state[layer.name("self_attn.qkv_proj.bias")][v_rows] /= s_v
    state[layer.mlp_norm] = state[layer.mlp_norm] / scale_inputs(gate_up)
    s_down = scale_inputs(down)
    state[gate_up][layer.intermediate:] /= s_down[:, None]  # the up rows
    skip = {qkv: layer.q_size + layer.kv_size}  # no clipping of q and k
    return {w: (awq.quantize(state[w], hessians[w], qtype, skip.get(w, 0)), hessians[w])
            for w in (qkv, o, gate_up, down)}


def _quantize_layer(model: torch.nn.Module, runner: LayerRunner, index: int, state: dict[str, torch.Tensor],
                    layer: _Layer, method: str, qtype: str, inputs: LayerInputs
                    ) -> dict[str, tuple[grid.Quantized, torch.Tensor]]:
    """awq or gptq on one layer (``inputs``: what its projections saw): name → (codes, the hessian
    the codes were chosen against)."""
    if method == "awq":
        attn, mlp = model.layers[index].self_attn, model.layers[index].mlp
        block_errors = {  # as the AWQ paper: q/k/v scales judged on the attention's output, gate/up on the MLP's
            layer.name("self_attn.qkv_proj.weight"):
                _block_error(attn.qkv_proj.weight, lambda: runner.attention_output(index, inputs)),
            layer.name("mlp.gate_up_proj.weight"):
                _block_error(mlp.gate_up_proj.weight, lambda: runner.mlp_output(index, inputs))}
        return _awq_layer(state, layer, inputs, qtype, block_errors)
    results = {}
    for proj in PROJECTIONS:
        w, h = layer.name(f"{proj}.weight"), inputs.stats[layer.name(proj)].mean_hessian()
        results[w] = (gptq(state[w], h, qtype), h)
    return results


def _error_row(model: torch.nn.Module, layer: _Layer, results: dict, stats: dict[str, InputStatistics],
               state: dict[str, torch.Tensor], qtype: str) -> dict:
    """Each projection's output error over its calibration inputs: this method's, round to
    nearest's, and the output's own size (all for the original weight and inputs)."""
    row: dict = {"layer": layer.prefix}
    for w, (q, h) in results.items():
        err = float(grid.output_error(state[w] - q.dequantize(), h))  # AWQ: of the scaled weight and inputs
        proj = w.removesuffix(".weight")
        h0, w0 = stats[proj].mean_hessian(), model.get_parameter(w).detach().float()
        row[proj.rsplit(".", 1)[1]] = {"error": err, "output": float(grid.output_error(w0, h0)),
                                       "rtn_error": float(grid.output_error(w0 - _rtn_approx(w0, qtype), h0))}
    return row


def quantize_projections(model: torch.nn.Module, method: str, qtype: str, samples: Sequence[list[int]] | None,
                         timings: dict[str, float] | None = None) -> tuple[dict[str, torch.Tensor], dict, list[dict]]:
    """(float parameters after any folding, quantized projections by parameter name, per-layer
    error summary). Quantized values are ggml bytes (np.uint8) for rtn, ``grid.Quantized`` otherwise.

    awq / gptq calibrate sequentially (layerwise.py): layer i's statistics come from the samples
    run through layers < i as already quantized, and layer i's quantized output feeds layer i + 1.
    The model's own parameters are changed while that runs and restored before returning (so
    their copies packed at load are dropped first: they would keep the old values)."""
    drop_packed_copies(model)
    state = {name: p.detach().float().clone() for name, p in model.named_parameters()}
    quantized: dict[str, grid.Quantized | np.ndarray] = {}
    summary = []
    layers = _layers(model)
    if method == "rtn":
        for layer in layers:
            for proj in PROJECTIONS:
                w = layer.name(f"{proj}.weight")
                quantized[w] = rtn_blocks(state[w], qtype)
        return state, quantized, summary
    if not samples:
        raise ValueError(f"{method} needs calibration samples")
    timings = {} if timings is None else timings
    clock = time.perf_counter()
    runner = LayerRunner(model, samples)
    originals: dict[str, torch.Tensor] = {}
    layers_s = time.perf_counter() - clock
    try:
        for i, layer in enumerate(layers):
            clock = time.perf_counter()
            inputs = runner.record(i, AWQ_SEARCH_CHUNKS if method == "awq" else 0)
            layers_s += time.perf_counter() - clock
            results = _quantize_layer(model, runner, i, state, layer, method, qtype, inputs)
            summary.append(_error_row(model, layer, results, inputs.stats, state, qtype))
            for w, (q, _) in results.items():
                quantized[w] = q
            if i + 1 < len(layers):
                clock = time.perf_counter()
                if SEQUENTIAL[method]:
                    _load_layer(model, layer, state, quantized, originals)
                runner.advance(i)
                layers_s += time.perf_counter() - clock
    finally:
        params = dict(model.named_parameters())
        for name, value in originals.items():
            params[name].data.copy_(value)
        timings["layers_s"] = layers_s
    return state, quantized, summary


def _load_layer(model: torch.nn.Module, layer: _Layer, state: dict[str, torch.Tensor], quantized: dict,
                originals: dict[str, torch.Tensor]) -> None:
    """Put ``layer``'s quantized projections (dequantized) and folded norms / biases into the model,
    keeping the originals in ``originals``."""
    for name, p in model.named_parameters():
        if name.startswith(layer.prefix + "."):
            originals.setdefault(name, p.detach().clone())
            value = quantized[name].dequantize() if name in quantized else state[name]
            p.data.copy_(value.to(p.dtype))


def _split(name: str, value, layer_sizes: dict[str, list[int]]):
    """pagoda's merged parameters back into the checkpoint's tensors (Hugging Face names)."""
    for merged, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
        if f".{merged}." in name:
            sizes = layer_sizes[merged]
            offsets = np.cumsum([0, *sizes])
            for part, start, stop in zip(parts, offsets[:-1], offsets[1:]):
                yield name.replace(merged, part), value[start:stop]
            return
    yield name, value


def _hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"


def checkpoint_tensors(model: torch.nn.Module, state: dict[str, torch.Tensor], quantized: dict,
                       qtype: str) -> Iterator[tuple[str, object]]:
    """Every tensor to write, under its Hugging Face name: quantized projections as BlockTensors,
    the embedding / head as Q8_0 blocks, the rest float32."""
    layer0 = model.layers[0]
    sizes = {"qkv_proj": [layer0.self_attn.q_size, layer0.self_attn.kv_size, layer0.self_attn.kv_size],
             "gate_up_proj": [layer0.mlp.intermediate_size] * 2}
    gemma_norms = type(model).__name__.startswith("Gemma")
    for name, value in state.items():
        if name in quantized:
            q = quantized[name]
            blocks = q if isinstance(q, np.ndarray) else grid.pack(q).numpy()
            for hf, part in _split(name, blocks, sizes):
                yield _hf_name(hf), BlockTensor(np.ascontiguousarray(part), qtype)
        elif name in ("embed_tokens.weight", "lm_head.weight"):
            yield _hf_name(name), BlockTensor(rtn_blocks(value, EMBEDDING_QTYPE), EMBEDDING_QTYPE)
        else:
            if gemma_norms and name.endswith("norm.weight"):
                value = value - 1.0  # pagoda holds Gemma's 1 + w; the writer adds the 1 back
            for hf, part in _split(name, value.numpy(), sizes):
                yield _hf_name(hf), np.ascontiguousarray(part, dtype=np.float32)


def load_float_model(model: str, kv_cache_memory: float = 1.0):
    """``model`` in float32 on pagoda's engine, prefix caching off (every calibration token runs)."""
    return LLM(model=model, dtype="float32", enable_prefix_caching=False, kv_cache_memory=kv_cache_memory)


def calibrate(llm, calibration: Path | str | None, num_samples: int, max_sample_tokens: int, seed: int = 0
              ) -> list[list[int]]:
    """The calibration samples (token ids) for ``llm``'s model, each within its context."""
    limit = min(max_sample_tokens, llm.engine.core.config.model.max_model_len - 1)
    return load_samples(calibration, llm.get_tokenizer(), num_samples, limit, seed)


def write_quantized(llm, out: Path | str, method: str, qtype: str, samples: Sequence[list[int]] | None,
                    result: QuantizeResult | None = None) -> QuantizeResult:
    """Quantize the model of ``llm`` with ``method`` (``samples``: from ``calibrate``; None for rtn)
    and write the GGUF ``out``; timings and errors into ``result``."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: choose from {', '.join(METHODS)}")
    if qtype not in grid.QTYPES:
        raise ValueError(f"unknown block type {qtype!r}: choose from {', '.join(grid.QTYPES)}")
    if method != "rtn" and not samples:
        raise ValueError(f"{method} needs calibration samples")
    check_architecture(llm.engine.core.config.model.architecture)
    out = Path(out)
    result = result or QuantizeResult(out, method, qtype)
    net = llm.engine.core.model
    start = time.perf_counter()
    with torch.inference_mode():
        timings: dict[str, float] = {}
        state, quantized, result.layers = quantize_projections(net, method, qtype, samples if method != "rtn" else None,
                                                               timings)
    result.calibration_s = timings.get("layers_s", 0.0)
    result.quantize_s = time.perf_counter() - start - result.calibration_s
    if samples and method != "rtn":
        result.samples, result.tokens = len(samples), sum(map(len, samples))
    rows = [v for layer in result.layers for k, v in layer.items() if k != "layer"]
    if rows:
        total = sum(r["output"] for r in rows)
        result.relative_error = sum(r["error"] for r in rows) / total
        result.rtn_relative_error = sum(r["rtn_error"] for r in rows) / total
    start = time.perf_counter()
    files = llm.engine.core.config.model.files
    out.parent.mkdir(parents=True, exist_ok=True)
    write_gguf(files.metadata_dir, out, qtype, name=f"{Path(files.name).stem} ({method} {qtype})",
               tensors=checkpoint_tensors(net, state, quantized, qtype))
    result.write_s = time.perf_counter() - start
    return result


def quantize_model(model: str, out: Path | str, method: str = "awq", qtype: str = "Q4_0",
                   calibration: Path | str | None = None, num_samples: int = 512, max_sample_tokens: int = 512,
                   seed: int = 0, kv_cache_memory: float = 1.0) -> QuantizeResult:
    """Quantize ``model`` (any ``--model`` form) with ``method`` to ``qtype`` blocks and write ``out`` (GGUF)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: choose from {', '.join(METHODS)}")
    if qtype not in grid.QTYPES:
        raise ValueError(f"unknown block type {qtype!r}: choose from {', '.join(grid.QTYPES)}")
    if Path(out).suffix != ".gguf":
        raise ValueError(f"the output must be a .gguf file, got {out}")
    result = QuantizeResult(Path(out), method, qtype)
    start = time.perf_counter()
    llm = load_float_model(model, kv_cache_memory)
    try:
        result.load_s = time.perf_counter() - start
        samples = calibrate(llm, calibration, num_samples, max_sample_tokens, seed) if method != "rtn" else None
        return write_quantized(llm, out, method, qtype, samples, result)
    finally:
        llm.shutdown()
