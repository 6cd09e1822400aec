"""GGUF LoRA adapters as llama.cpp writes them: a PEFT adapter converted by llama.cpp's own
convert_lora_to_gguf.py (from the sources vendored in the llama-cpp-python sdist, fetched from
PyPI) gives the tokens transformers + peft give with the PEFT original."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from pagoda import LLM, SamplingParams
from pagoda.lora import LoRARequest
from pagoda.lora.adapter_files import read_adapter
from pagoda.lora.adapter import AdapterError
from tests.gguf_export import export_gguf
from tests.lora.adapters import make_peft_adapter, peft_greedy

MAX_TOKENS = 10
_NEEDED = ("convert_lora_to_gguf.py", "convert_hf_to_gguf.py", "conversion/", "gguf-py/")


@pytest.fixture(scope="module")
def llama_cpp_converter(tmp_path_factory) -> Path:
    """llama.cpp's converter scripts, extracted from the llama-cpp-python sdist."""
    root = tmp_path_factory.mktemp("llama-cpp")
    fetched = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                              "llama-cpp-python", "-d", str(root), "-q"], capture_output=True, text=True)
    sdists = list(root.glob("llama_cpp_python-*.tar.gz"))
    if fetched.returncode != 0 or not sdists:
        pytest.skip(f"the llama-cpp-python sdist could not be fetched: {fetched.stderr[-300:]}")
    with tarfile.open(sdists[0]) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name
                   and m.name.split("/vendor/llama.cpp/", 1)[1].startswith(_NEEDED)]
        tar.extractall(root, members=members, filter="data")
    return next(root.glob("llama_cpp_python-*/vendor/llama.cpp"))


def _convert(converter: Path, base: Path, adapter: Path, out: Path) -> Path:
    subprocess.run([sys.executable, "convert_lora_to_gguf.py", "--base", str(base), "--outfile", str(out),
                    "--outtype", "f32", str(adapter)], cwd=converter, check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(converter / "gguf-py")})
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_llama_cpp_gguf_adapter_equals_peft(tiny_model_dirs, tmp_path, llama_cpp_converter, arch):
    base = tiny_model_dirs[arch]
    peft_dir = make_peft_adapter(base, tmp_path / "peft", seed=4)
    gguf = _convert(llama_cpp_converter, base, peft_dir, tmp_path / "adapter.gguf")
    llm = LLM(model=str(base), dtype="float32", kv_cache_memory=0.02, enable_lora=True)
    prompts = ["Hello there friend", "The quick brown fox jumps over"]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=LoRARequest("g", 1, str(gguf)))
    want = peft_greedy(base, peft_dir, [o.prompt_token_ids for o in outs], MAX_TOKENS)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_a_model_gguf_is_not_an_adapter(tiny_llama, tmp_path):
    hf_config = json.loads((tiny_llama / "config.json").read_text())
    model_file = export_gguf(tiny_llama, tmp_path / "tiny.gguf", "Q8_0")
    with pytest.raises(AdapterError, match="not a LoRA adapter"):
        read_adapter(str(model_file), hf_config, max_rank=16)
