"""Hostile model files: what their metadata may cost, and the sizes allocations are taken from.

A 500k-item array in a 4 MB GGUF converts in bounded memory (it cost ~820 MiB through
transformers' AutoTokenizer); the metadata's arrays and strings are capped; a context_length of
2^32-1 is refused by name, and a long one (2^24) is capped to what the KV budget holds before the
rotary tables are sized from it (it cost ~4.7 GiB); block_count and embedding_length must be the
file's own; a zero-length tensor dimension, in a GGUF or a safetensors file, is an error naming
the tensor. Peak memory is measured in a subprocess (resource.getrusage)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_export import export_gguf
from safetensors.torch import load_file, save_file

from pagoda.loader import gguf_file
from pagoda.loader.gguf_config import MAX_CONTEXT_LENGTH, gguf_to_hf_config
from pagoda.loader.gguf_file import read_gguf
from pagoda.loader.safetensors import iter_safetensors_weights

TESTS = Path(__file__).resolve().parents[1]


def _variant(hf_dir: Path, out: Path, **config) -> Path:
    """A copy of ``hf_dir`` with ``config`` changed in its config.json."""
    shutil.copytree(hf_dir, out)
    data = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**data, **config}))
    return out


def _peak_mib(code: str, *args: str) -> list[str]:
    """Run ``code`` in a fresh interpreter; its output lines, the last being the peak RSS growth
    (MiB) over what the process had once the imports were done."""
    script = ("import resource, sys\nsys.path.insert(0, sys.argv[1])\nfrom pagoda import LLM\n"
              "from pagoda.loader.gguf_model_dir import convert_gguf_metadata\n"
              "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n" + code +
              "\nprint((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)\n")
    done = subprocess.run([sys.executable, "-c", script, str(TESTS), *args], capture_output=True, text=True,
                          check=False, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # tokenizer from its fields; through AutoTokenizer
def test_a_500k_item_array_converts_in_bounded_memory(tiny_model_dirs, tmp_path, arch):
    path = export_gguf(tiny_model_dirs[arch], tmp_path / "junk.gguf",
                       customize=lambda w: w.add_array("junk.strings", [""] * 500_000))
    assert path.stat().st_size < 5 << 20
    (grown,) = _peak_mib("convert_gguf_metadata(sys.argv[2], sys.argv[3])", str(path), str(tmp_path / "out"))
    assert int(grown) < 200  # before: ~820 MiB (AutoTokenizer parsed every field, one element at a time)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == arch


def _metadata_only(path: Path, add) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    add(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_metadata_arrays_and_strings_are_capped(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_file, "MAX_METADATA_ITEMS", 1000)
    monkeypatch.setattr(gguf_file, "MAX_STRING_BYTES", 100)
    fine = _metadata_only(tmp_path / "fine.gguf", lambda w: (w.add_array("a", list(range(600))),
                                                             w.add_array("b", ["x" * 100] * 400)))
    assert len(read_gguf(fine).metadata["b"]) == 400  # 1000 items together, strings of 100 bytes: allowed
    many = _metadata_only(tmp_path / "many.gguf", lambda w: (w.add_array("a", list(range(600))),
                                                             w.add_array("b", [""] * 401)))
    with pytest.raises(ValueError, match=r"not a valid GGUF file: metadata array 'b' has 401 items; .* at most 1000"):
        read_gguf(many)
    long = _metadata_only(tmp_path / "long.gguf", lambda w: w.add_string("tokenizer.chat_template", "x" * 101))
    with pytest.raises(ValueError, match=r"metadata 'tokenizer.chat_template' is a string of 101 bytes \(at most 100\)"):
        read_gguf(long)


def test_a_context_length_no_model_has_is_refused(tiny_llama, tmp_path):
    hf_dir = _variant(tiny_llama, tmp_path / "hf", max_position_embeddings=2**32 - 1)
    gf = read_gguf(export_gguf(hf_dir, tmp_path / "ctx.gguf"))
    with pytest.raises(ValueError, match=rf"llama\.context_length = 4294967295 is not a positive integer of at "
                                         rf"most {MAX_CONTEXT_LENGTH}"):
        gguf_to_hf_config(gf)  # before: accepted, and the load tried to allocate 34 GB of rotary positions


def test_a_long_context_is_capped_to_the_kv_budget_before_loading(tiny_llama, tmp_path):
    hf_dir = _variant(tiny_llama, tmp_path / "hf", max_position_embeddings=MAX_CONTEXT_LENGTH)
    path = export_gguf(hf_dir, tmp_path / "long.gguf")
    code = ("llm = LLM(model=sys.argv[2], dtype='float32', kv_cache_memory=0.01)\n"
            "print(llm.engine.config.model.max_model_len)")
    configured, grown = _peak_mib(code, str(path))
    # 0.01 GiB over one layer's K and V per token (2 KV heads x 16 x float32 x 2): 41943 tokens
    assert int(configured) == int(0.01 * 2**30) // (2 * 2 * 16 * 4)
    assert int(grown) < 500  # before: ~4.7 GiB of rotary tables for 16M positions


def test_block_count_and_width_are_the_files_own(tiny_llama, tmp_path):
    weights = load_file(tiny_llama / "model.safetensors")
    one_layer = {k: v for k, v in weights.items() if ".layers.1." not in k}
    hf_dir = _variant(tiny_llama, tmp_path / "hf", num_hidden_layers=2)
    save_file(one_layer, hf_dir / "model.safetensors")
    gf = read_gguf(export_gguf(hf_dir, tmp_path / "layers.gguf"))
    with pytest.raises(ValueError, match=r"block_count = 2, but the file holds tensors for 1 layers"):
        gguf_to_hf_config(gf)


def test_a_zero_length_dimension_names_the_tensor(tmp_path):
    path = tmp_path / "zero.gguf"
    _metadata_only(path, lambda w: w.add_tensor("blk.0.ffn_up.weight", np.zeros((0, 8), np.float32)))
    with pytest.raises(ValueError, match=r"tensor 'blk\.0\.ffn_up\.weight' has a zero-length dimension: shape \[0, 8\]"):
        read_gguf(path)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(8, 4), "model.norm.weight": torch.zeros(0)},
              hf_dir / "model.safetensors")
    with pytest.raises(ValueError, match=r"tensor 'model\.norm\.weight' has a zero-length dimension: shape \[0\]"):
        list(iter_safetensors_weights(hf_dir))
