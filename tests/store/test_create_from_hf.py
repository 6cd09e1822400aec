"""`pagoda create` FROM a Hugging Face directory: written as a GGUF (pagoda/loader/gguf_writer.py)
that loads to the same greedy output, in F16 by default or the type `quantize` names, readable
by the gguf package as llama.cpp would read it; what cannot be written is refused by name."""

from __future__ import annotations

import json
import shutil

import gguf
import pytest

from pagoda import LLM, SamplingParams
from pagoda.loader.gguf_writer_tokenizer import pre_tokenizer_name
from pagoda.store import create
from pagoda.store.layout import default_layout
from pagoda.store.modelfile import ModelfileError, parse_modelfile

PROMPTS = ["the quick brown fox", "hello there, how"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def greedy(model: str) -> list[list[int]]:
    llm = LLM(model=model, dtype="float32", kv_cache_memory=0.01)
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]


def model_file(name: str):
    layout, _, manifest = create.locate(name)
    return create.model_path_of(layout, manifest)


def test_from_a_hf_directory_in_f32_gives_the_same_tokens(fresh_home, tiny_llama):
    create.create_model("conv:f32", parse_modelfile(f"FROM {tiny_llama}\nSYSTEM Be brief.\n"), quantize="f32")
    assert greedy("conv:f32") == greedy(str(tiny_llama))
    reader = gguf.GGUFReader(model_file("conv:f32"))
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    assert {t.name for t in reader.tensors} >= {"token_embd.weight", "blk.0.attn_q.weight", "output_norm.weight"}


def test_default_f16_and_quantized_types(fresh_home, tiny_llama):
    create.create_model("conv:f16", parse_modelfile(f"FROM {tiny_llama}\n"))
    create.create_model("conv:q8", parse_modelfile(f"FROM {tiny_llama}\n"), quantize="q8_0")
    types = {name: {t.name: t.tensor_type.name for t in gguf.GGUFReader(model_file(name)).tensors}
             for name in ("conv:f16", "conv:q8")}
    assert types["conv:f16"]["blk.0.ffn_up.weight"] == "F16" and types["conv:q8"]["blk.0.ffn_up.weight"] == "Q8_0"
    assert types["conv:q8"]["blk.0.attn_norm.weight"] == "F32"  # norms stay F32
    llm = LLM(model="conv:q8", kv_cache_memory=0.01, quantization="gguf")  # the fast path takes it as is
    assert len(llm.generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids) == 12
    assert not list(default_layout().blobs_dir.glob(".convert-*"))  # the temporary GGUF is gone


def test_what_cannot_be_written_is_refused_by_name(fresh_home, tiny_llama, tiny_gguf, tmp_path):
    with pytest.raises(ValueError, match="quantize must be one of"):
        create.create_model("x", parse_modelfile(f"FROM {tiny_llama}\n"), quantize="q4_K_M")
    with pytest.raises(ValueError, match="keeps its own quantization"):
        create.create_model("x", parse_modelfile(f"FROM {tiny_gguf}\n"), quantize="q8_0")
    odd = tmp_path / "odd"
    shutil.copytree(tiny_llama, odd)
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    with pytest.raises(ModelfileError, match="gpt_neox"):
        create.create_model("x", parse_modelfile(f"FROM {odd}\n"))
    with pytest.raises(ValueError):  # nothing was stored under "x"
        create.locate("x")


def test_pre_tokenizer_names():
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    assert pre_tokenizer_name(byte_level) == "gpt-2"
    digits = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level]}
    assert pre_tokenizer_name(digits) == "smollm"  # SmolLM2's tokenizer.json
    with pytest.raises(ValueError, match="pre-tokenizer"):
        pre_tokenizer_name({"type": "Whitespace"})
