"""Sequential calibration (pagoda/quantize/layerwise.py) on the tiny models.

- The layer runner computes what the engine computes: the samples run layer by layer through
  pagoda's own modules give the engine's own prompt logprobs (Llama, Qwen2's biases, Gemma 3's
  norms and sliding windows).
- A layer's statistics count every token of every sample, and its captured block inputs
  reproduce the block outputs the layer computes.
- quantize_projections is sequential: layer 1's statistics are those of the samples run through
  layer 0 as quantized (not the float layer 0), and the model's own weights are restored after.
"""

from __future__ import annotations

import pytest
import torch

from pagoda import SamplingParams
from pagoda.quantize import grid, quantizer
from pagoda.quantize.layerwise import LayerRunner
from pagoda.quantize.quantizer import _layers, load_float_model, quantize_projections

SAMPLES = [[5, 17, 3, 99, 42, 7, 8, 1, 2], [11, 12], [64, 65, 66, 67, 68, 69, 70], [3] * 20]


def _engine_logprobs(llm, ids: list[int]) -> list[float]:
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [pos[tok].logprob for tok, pos in zip(ids[1:], out[0].prompt_logprobs[1:])]


def _runner_logprobs(model, runner: LayerRunner) -> list[list[float]]:
    with torch.inference_mode():
        hidden, _ = model.norm(runner.hidden.clone(), runner.residual.clone())
        logprobs = torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)
    out, start = [], 0
    for ids in SAMPLES:
        out.append([float(logprobs[start + i, ids[i + 1]]) for i in range(len(ids) - 1)])
        start += len(ids)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_layer_by_layer_equals_the_engine(arch, tiny_model_dirs):
    with load_float_model(str(tiny_model_dirs[arch]), kv_cache_memory=0.02) as llm:
        model = llm.engine.core.model
        runner = LayerRunner(model, SAMPLES, chunk_tokens=16)  # several chunks, one sample longer than a chunk
        assert len(runner.chunks) > 2
        for i in range(len(model.layers)):
            runner.advance(i)
        ours = _runner_logprobs(model, runner)
        for ids, got in zip(SAMPLES, ours):
            assert got == pytest.approx(_engine_logprobs(llm, ids), abs=1e-4)


def test_statistics_and_block_inputs(tiny_llama):
    with load_float_model(str(tiny_llama), kv_cache_memory=0.02) as llm:
        model = llm.engine.core.model
        runner = LayerRunner(model, SAMPLES, chunk_tokens=16)
        runner.advance(0)
        inputs = runner.record(1, capture_chunks=2)
        tokens = sum(map(len, SAMPLES))
        assert {s.tokens for s in inputs.stats.values()} == {tokens}
        assert len(inputs.stats) == 4
        captured = inputs.chunks[-1][3]
        assert captured == inputs.chunks[1][3] < tokens and inputs.attention.shape == (captured, 64)
        layer = model.layers[1]
        with torch.inference_mode():
            assert torch.equal(runner.mlp_output(1, inputs), layer.mlp(inputs.mlp.clone()))
        everything = runner.record(1, capture_chunks=len(runner.chunks))
        for name, x in (("self_attn.qkv_proj", everything.attention), ("mlp.gate_up_proj", everything.mlp)):
            assert x.shape[0] == tokens
            assert torch.allclose(everything.stats[f"layers.1.{name}"].hessian, x.T @ x, rtol=1e-4, atol=1e-4)
        assert torch.equal(everything.stats["layers.1.mlp.down_proj"].hessian, inputs.stats["layers.1.mlp.down_proj"].hessian)

@pytest.mark.parametrize("sequential", [True, False])
def test_quantization_statistics_and_the_model_restored(tiny_llama, monkeypatch, sequential):
    """Sequential: layer 1's recorded inputs are the outputs of layer 0 as quantized (awq's
    default); one pass: those of the float model (gptq's default). The model is restored."""
    monkeypatch.setitem(quantizer.SEQUENTIAL, "gptq", sequential)
    with load_float_model(str(tiny_llama), kv_cache_memory=0.02) as llm:
        model = llm.engine.core.model
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        state, quantized, summary = quantize_projections(model, "gptq", "Q4_0", SAMPLES)
        for n, p in model.named_parameters():
            assert torch.equal(p, before[n]), n

        layer0 = _layers(model)[0]
        float_runner = LayerRunner(model, SAMPLES)
        float_runner.advance(0)
        float_stats = float_runner.record(1).stats
        for n, p in model.named_parameters():  # layer 0 as written to the file
            if n.startswith(layer0.prefix + "."):
                p.data.copy_(quantized[n].dequantize() if n in quantized else state[n])
        quant_runner = LayerRunner(model, SAMPLES)
        quant_runner.advance(0)
        quant_stats = quant_runner.record(1).stats
        for n, p in model.named_parameters():
            p.data.copy_(before[n])

        down = "layers.1.mlp.down_proj"
        w = before[f"{down}.weight"]
        recorded = summary[1]["down_proj"]["output"]
        seen, other = (quant_stats, float_stats) if sequential else (float_stats, quant_stats)
        assert recorded == pytest.approx(float(grid.output_error(w, seen[down].mean_hessian())), rel=1e-5)
        assert recorded != pytest.approx(float(grid.output_error(w, other[down].mean_hessian())), rel=1e-3)
