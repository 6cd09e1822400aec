"""`pagoda quantize` end to end on the tiny Llama: the GGUF it writes has the expected tensors
(read by the `gguf` package, as llama.cpp would), loads in pagoda's fast path and generates,
and stays close to the float model (at 8 bits, so closely that a wrong AWQ fold would show)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from pagoda import LLM, SamplingParams
from pagoda.quantize.calibration import load_samples, read_records
from pagoda.quantize.quantizer import quantize_model

PROMPT = "the quick brown fox jumps over the lazy dog and then some more words follow"
PROJECTIONS = {"attn_q": (64, 64), "attn_k": (64, 32), "attn_v": (64, 32), "attn_output": (64, 64),
               "ffn_gate": (64, 128), "ffn_up": (64, 128), "ffn_down": (128, 64)}  # gguf's (columns, rows)


@pytest.fixture(scope="module")
def calibration_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("calibration") / "samples.jsonl"
    records = [{"text": f"Sample {i}: the quick brown fox jumps over the lazy dog {i * 7} times."} for i in range(16)]
    records += [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                              {"role": "assistant", "content": f"It is {2 * i}."}]} for i in range(4)]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def _prompt_logprobs(llm: LLM, ids: list[int]) -> list[float]:
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [pos[tok].logprob for tok, pos in zip(ids[1:], out[0].prompt_logprobs[1:])]


def _mean_logprob_change(path: Path, tiny_llm, quantization: str | None = None) -> float:
    ids = tiny_llm.get_tokenizer().encode(PROMPT)
    ref = _prompt_logprobs(tiny_llm, ids)
    with LLM(model=str(path), dtype="float32", quantization=quantization, kv_cache_memory=0.02) as llm:
        got = _prompt_logprobs(llm, ids)
    return sum(abs(a - b) for a, b in zip(ref, got)) / len(ref)


def test_command_writes_a_gguf_that_gguf_reads_and_pagoda_serves(tiny_llama, tiny_llm, tmp_path):
    out, summary = tmp_path / "tiny-awq.gguf", tmp_path / "summary.json"
    proc = subprocess.run([sys.executable, "-m", "pagoda.cli", "quantize", str(tiny_llama),
                           "--method", "awq", "--bits", "4", "--num-samples", "24", "-o", str(out),
                           "--summary", str(summary)],  # the calibration set shipped with pagoda
                          check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out} (awq, Q4_0): 24 samples" in proc.stderr

    reader = gguf.GGUFReader(str(out))
    tensors = {t.name: t for t in reader.tensors}
    for layer in range(2):
        for name, shape in PROJECTIONS.items():
            t = tensors[f"blk.{layer}.{name}.weight"]
            assert (t.tensor_type.name, tuple(int(n) for n in t.shape)) == ("Q4_0", shape)
        for norm in ("attn_norm", "ffn_norm"):
            assert tensors[f"blk.{layer}.{norm}.weight"].tensor_type.name == "F32"
    assert tensors["token_embd.weight"].tensor_type.name == "Q8_0"
    assert tensors["output.weight"].tensor_type.name == "Q8_0"  # the tiny Llama's head is untied
    file_type = reader.fields["general.file_type"]
    assert gguf.LlamaFileType(int(file_type.parts[file_type.data[0]][0])) == gguf.LlamaFileType.MOSTLY_Q4_0

    report = json.loads(summary.read_text())
    assert report["samples"] == 24 and report["tokens"] > 24
    assert report["relative_error"] < report["rtn_relative_error"]  # on the calibration activations

    with LLM(model=str(out), quantization="gguf", kv_cache_memory=0.02) as llm:  # the block kernels
        text = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
        assert len(text[0].outputs[0].token_ids) == 8
    assert _mean_logprob_change(out, tiny_llm, "gguf") < 0.25  # 4-bit on a random model: 0.10 when written


@pytest.mark.parametrize(("method", "qtype", "bound"), [("rtn", "Q8_0", 0.03), ("awq", "Q8_0", 0.03),
                                                        ("gptq", "Q8_0", 0.03), ("gptq", "Q4_1", 0.25)])
def test_quantized_model_stays_close_to_the_float_one(method, qtype, bound, tiny_llama, tiny_llm, calibration_file,
                                                      tmp_path):
    out = tmp_path / f"tiny-{method}-{qtype}.gguf"
    result = quantize_model(str(tiny_llama), out, method, qtype, calibration_file, num_samples=20, kv_cache_memory=0.02)
    assert result.samples == (20 if method != "rtn" else 0)
    types = {t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors if t.name.startswith("blk.")}
    assert types == {qtype, "F32"}
    assert _mean_logprob_change(out, tiny_llm) < bound  # 8 bits: ~0.01, most of it the Q8_0 embedding


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_awq_folds_into_other_families(arch, tiny_model_dirs, calibration_file, tmp_path):
    """Qwen2's v bias and Gemma 3's (1 + w) norms before its MLP take AWQ's scales too: at 8 bits
    the output stays as close to the float model as round to nearest's."""
    model = tiny_model_dirs[arch]
    out = tmp_path / f"{arch}-awq.gguf"
    quantize_model(str(model), out, "awq", "Q8_0", calibration_file, num_samples=20, kv_cache_memory=0.02)
    with LLM(model=str(model), dtype="float32", kv_cache_memory=0.02) as ref:
        assert _mean_logprob_change(out, ref) < 0.03


def test_calibration_records_and_their_errors(tmp_path, tiny_llm, calibration_file):
    tokenizer = tiny_llm.get_tokenizer()
    samples = load_samples(calibration_file, tokenizer, 8, max_tokens=6)
    assert len(samples) == 8 and all(1 <= len(s) <= 6 for s in samples)
    assert load_samples(calibration_file, tokenizer, 8, 6) == samples  # seeded: repeatable
    assert len(load_samples(calibration_file, tokenizer, 100, 6)) == 20  # fewer than asked: all
    assert len(read_records(Path(__file__).parents[2] / "pagoda" / "quantize" / "data" / "calibration.jsonl")) >= 512

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        read_records(bad)
    bad.write_text('{"text": "fine"}\n\n{"prompt": "wrong key"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: expected"):
        read_records(bad)
    with pytest.raises(ValueError, match="does not exist"):
        read_records(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="must be a .gguf"):
        quantize_model("unused", tmp_path / "out.bin")


def test_command_refuses_bad_options(tmp_path, capsys):
    from pagoda.cli import main

    assert main(["quantize", "unused", "--bits", "8", "--zero-point", "-o", str(tmp_path / "x.gguf")]) == 1
    assert "pagoda: error: 8-bit blocks (Q8_0) have no zero point" in capsys.readouterr().err
