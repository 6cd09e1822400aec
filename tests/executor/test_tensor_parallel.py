"""Tensor parallelism at TP=2 on this machine: the same tokens as TP=1 (logprobs within 1e-5),
in mixed batches with chunked prefill and preemption, in gguf mode, with each rank holding half
of the weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from gguf_export import export_gguf

from pagoda import LLM, SamplingParams
from pagoda.layers.ggml_blocks import BlockLinear

# tests/loader/test_gguf_quantized.py's bound for single-rank gguf mode against the fp32 path
FAST_LOGPROB_BOUND = 0.02

ARCHS = ["llama", "qwen2", "qwen3"]
LOGPROB_TOLERANCE = 1e-5
# A mixed workload: short and long prompts (longer than the token budget, so chunked), greedy with
# logprobs, prompt logprobs, and a seeded random sample.
PROMPTS = ["hello world", "def main():\n    print('hello world')\n" * 4, "the quick brown fox " * 6, "a b c d e f g",
           "once upon a time " * 5, "x"]
PARAMS = [SamplingParams(max_tokens=16, temperature=0.0, logprobs=2),
          SamplingParams(max_tokens=16, temperature=0.0, logprobs=2, prompt_logprobs=1),
          SamplingParams(max_tokens=16, temperature=0.8, seed=7, logprobs=2)]
# Small: prompts are chunked (budget 32 tokens) and requests preempted (~100 KiB of KV cache).
ENGINE = dict(dtype="float32", kv_cache_memory=0.0001, max_num_batched_tokens=32, max_num_seqs=8)


def _run(llm: LLM) -> list:
    params = [PARAMS[i % len(PARAMS)] for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [max(p.values(), key=lambda lp: lp.logprob).logprob for p in o.outputs[0].logprobs],
             [lp for p in (o.prompt_logprobs or [])[1:] for lp in sorted((t, v.logprob) for t, v in p.items())])
            for o in outs]


def _assert_same(got: list, want: list, tolerance: float = LOGPROB_TOLERANCE) -> None:
    for (tokens, lps, prompt_lps), (want_tokens, want_lps, want_prompt_lps) in zip(got, want):
        assert tokens == want_tokens
        assert max((abs(a - b) for a, b in zip(lps, want_lps)), default=0.0) <= tolerance
        assert [t for t, _ in prompt_lps] == [t for t, _ in want_prompt_lps]
        assert max((abs(a[1] - b[1]) for a, b in zip(prompt_lps, want_prompt_lps)), default=0.0) <= tolerance


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_gives_tp1_tokens_with_chunked_prefill_and_preemption(arch, tiny_model_dirs):
    path = str(tiny_model_dirs[arch])
    want = _run(LLM(path, **ENGINE))
    with LLM(path, tensor_parallel_size=2, **ENGINE) as tp2:
        assert tp2.engine.core.executor.driver_worker.tp.world_size == 2
        got = _run(tp2)
        assert tp2.engine.core.scheduler.num_preemptions_total > 0
        assert tp2.engine.core.kv_manager.usage() == 0.0
        # The second pass meets prefix-cache hits: still the first pass's tokens.
        assert [t for t, _, _ in _run(tp2)] == [t for t, _, _ in got]
    _assert_same(got, want)


def test_each_rank_holds_half_of_the_weights(tiny_llama):
    with LLM(str(tiny_llama), **ENGINE) as tp1, LLM(str(tiny_llama), tensor_parallel_size=2, **ENGINE) as tp2:
        (whole,) = tp1.engine.core.executor.collective_rpc("memory_report")
        ranks = tp2.engine.core.executor.collective_rpc("memory_report")
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["pid"] != ranks[1]["pid"]
    for r in ranks:  # norms are replicated: a little over half
        assert 0.5 <= r["weight_bytes"] / whole["weight_bytes"] < 0.52


def test_each_rank_loads_half_the_model_measured_in_resident_memory(tmp_path_factory):
    """Resident memory, not only parameter bytes: each rank reads its slice of the checkpoint, so
    loading adds about half of what TP=1's load adds (a 34M-parameter model, 134 MB in fp32).
    Every engine runs in a fresh process (the model is written by another), so no memory freed
    earlier is reused and hides what loading costs."""
    path = tmp_path_factory.mktemp("mid_llama")
    _python(f"""
import sys, pathlib, torch, transformers
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
from tiny_models import make_tokenizer
make_tokenizer(pathlib.Path({str(path)!r}))
config = transformers.LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                                  num_key_value_heads=4, vocab_size=8192, max_position_embeddings=256)
torch.manual_seed(0)
transformers.LlamaForCausalLM(config).save_pretrained({str(path)!r}, safe_serialization=True)
""")
    report = """
import json, sys
from pagoda import LLM
with LLM(sys.argv[1], dtype="float32", kv_cache_memory=0.01, tensor_parallel_size=int(sys.argv[2])) as llm:
    print(json.dumps(llm.engine.core.executor.collective_rpc("memory_report")))
"""
    (whole,) = json.loads(_python(report, str(path), "1").splitlines()[-1])
    ranks = json.loads(_python(report, str(path), "2").splitlines()[-1])
    assert whole["weights_rss_bytes"] > 0.9 * whole["weight_bytes"]  # the measure sees the weights
    for r in ranks:
        ratio = r["weights_rss_bytes"] / whole["weights_rss_bytes"]
        print(f"rank {r['rank']}: loading added {r['weights_rss_bytes'] / 2**20:.0f} MiB of resident memory, "
              f"{ratio:.2f} of TP=1's {whole['weights_rss_bytes'] / 2**20:.0f} MiB")
        assert 0.4 < ratio < 0.65


def _quickstart(tmp_path: Path, model: Path) -> Path:
    """A script as vLLM's quickstart writes it: the LLM built at the top level, no main guard."""
    script = tmp_path / "quickstart.py"
    script.write_text(textwrap.dedent(f"""
        import json
        from pagoda import LLM, SamplingParams
        llm = LLM(model={str(model)!r}, tensor_parallel_size=2, dtype="float32", kv_cache_memory=0.01)
        outs = llm.generate({PROMPTS[:3]!r}, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
        print(json.dumps([o.outputs[0].token_ids for o in outs]))
    """))
    return script


def test_tp2_from_a_plain_script_without_a_main_guard(tiny_llama, tmp_path):
    """Spawned ranks re-imported the script, whose top level built the LLM again, and
    multiprocessing refused ("... before the current process has finished its bootstrapping
    phase"). On CPU the ranks are forked now, as vLLM's are: the script gives TP=1's tokens."""
    env = {k: v for k, v in os.environ.items() if k != "PAGODA_WORKER_MULTIPROC_METHOD"}
    out = subprocess.run([sys.executable, str(_quickstart(tmp_path, tiny_llama))], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "leaked" not in out.stderr, out.stderr[-3000:]  # the ranks share rank 0's resource tracker
    with LLM(str(tiny_llama), dtype="float32", kv_cache_memory=0.01) as tp1:
        want = [o.outputs[0].token_ids
                for o in tp1.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)]
    assert json.loads(out.stdout.splitlines()[-1]) == want


def test_spawned_ranks_and_no_main_guard_fail_at_once_saying_what_to_write(tiny_llama, tmp_path):
    """Where the ranks must be spawned (CUDA initialized, threads running, or asked for), the same
    script fails before any rank starts, naming the line and the fix."""
    env = dict(os.environ, PAGODA_WORKER_MULTIPROC_METHOD="spawn")
    started = time.monotonic()
    out = subprocess.run([sys.executable, str(_quickstart(tmp_path, tiny_llama))], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env=env)
    assert out.returncode == 1
    assert "quickstart.py again in every rank: line 4 would start the engine" in out.stderr, out.stderr[-3000:]
    assert 'under `if __name__ == "__main__":`' in out.stderr
    assert "bootstrapping phase" not in out.stderr
    print(f"failed in {time.monotonic() - started:.1f}s")


def _python(code: str, *args: str) -> str:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_gguf_mode_under_tp2_stays_within_the_single_rank_tolerance(qtype, tiny_llama, tmp_path_factory):
    """Q4/Q8 blocks are split along whole blocks and each rank multiplies its own with the
    integer kernel. The fp32 sums meet in a different order, and a last-bit change can move an
    activation's int8 rounding, so gguf mode under TP is held to the bound single-rank gguf mode
    is held to (tests/loader/test_gguf_quantized.py): mean |logprob difference| against the fp32
    dequantized path."""
    path = str(export_gguf(tiny_llama, tmp_path_factory.mktemp("tp_gguf") / f"llama-{qtype}.gguf", qtype))
    reference = _run(LLM(path, **ENGINE))
    single = _run(LLM(path, quantization="gguf", **ENGINE))
    with LLM(path, tensor_parallel_size=2, quantization="gguf", **ENGINE) as tp2:
        kernels = tp2.engine.core.model.backend.has_cpu_kernels  # else torch's int4 layers (Q8_0 stays float)
        assert any(isinstance(m, BlockLinear) for m in tp2.engine.core.model.modules()) == kernels
        got = _run(tp2)
    bound = max(_mean_logprob_gap(single, reference), FAST_LOGPROB_BOUND)
    assert _mean_logprob_gap(got, reference) < bound


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_modes_under_tp2(mode, tiny_llama):
    """int8 / int4 quantize each rank's shard: row-parallel shards split the input at multiples of
    the 32-element blocks, so the blocks are TP=1's, and TP=2 stays within the fast path's bound
    of single-rank output in the same mode (only the order of fp32 sums, and so an activation's
    int8 rounding now and then, differ)."""
    single = _run(LLM(str(tiny_llama), quantization=mode, **ENGINE))
    with LLM(str(tiny_llama), tensor_parallel_size=2, quantization=mode, **ENGINE) as tp2:
        got = _run(tp2)
    assert _mean_logprob_gap(got, single) < FAST_LOGPROB_BOUND


def _mean_logprob_gap(got: list, want: list) -> float:
    """Mean |logprob difference| over the positions where both runs chose the same token."""
    gaps = []
    for (tokens, lps, _), (want_tokens, want_lps, _) in zip(got, want):
        for t, w, a, b in zip(tokens, want_tokens, lps, want_lps):
            if t != w:
                break
            gaps.append(abs(a - b))
    return sum(gaps) / len(gaps)


def test_tp_size_must_fit_the_model(tiny_llama):
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads"):
        LLM(str(tiny_llama), tensor_parallel_size=3, **ENGINE)


def test_smollm2_tp3_gives_tp1_tokens(smollm2_gguf):
    """The real model. SmolLM2-135M has 9 attention heads and 3 KV heads, so 3 is the smallest
    tensor-parallel size it takes (TP=2 is refused, as vLLM refuses it); 3 ranks share the 2 cores."""
    args = dict(dtype="float32", kv_cache_memory=0.05, max_num_batched_tokens=64)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)

    def run(llm: LLM) -> list:
        return [(o.outputs[0].token_ids, [max(p.values(), key=lambda lp: lp.logprob).logprob for p in o.outputs[0].logprobs])
                for o in llm.generate(prompts, params, use_tqdm=False)]

    with LLM(str(smollm2_gguf), **args) as tp1:
        want = run(tp1)
    with pytest.raises(ValueError, match="9 attention heads"):
        LLM(str(smollm2_gguf), tensor_parallel_size=2, **args)
    with LLM(str(smollm2_gguf), tensor_parallel_size=3, **args) as tp3:
        got = run(tp3)
    for (tokens, lps), (want_tokens, want_lps) in zip(got, want):
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(lps, want_lps)) <= LOGPROB_TOLERANCE
