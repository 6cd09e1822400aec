"""Write a tiny Hugging Face model directory (tests/tiny_models.py) as a GGUF file, the way llama.cpp's
``convert_hf_to_gguf.py`` would: llama.cpp metadata keys and tensor names, Q/K rows permuted for the
``llama`` architecture, 2-D weights quantized with ``gguf.quants.quantize``, norms and biases in F32.

This lets the GGUF loader be tested against weights we know, without downloading a model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType

# Types gguf.quants can *write*. Q4_K/Q5_K/Q6_K it can only read, and they need rows of 256,
# which a tiny model (hidden 64) does not have.
EXPORT_QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")

_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_tensor_name(hf_name: str) -> str:
    """llama.cpp's name for an HF parameter (``model.layers.3.mlp.up_proj.weight`` → ``blk.3.ffn_up.weight``)."""
    stem, _, suffix = hf_name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{_LAYER_NAMES[rest]}.{suffix}"


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (HF rotate-half row order → interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantize_weight(w: np.ndarray, qtype: str) -> np.ndarray:
    """``w`` in the storage form GGUFWriter takes for ``qtype`` (raises ValueError where gguf cannot)."""
    if qtype not in EXPORT_QTYPES:
        raise ValueError(f"cannot export {qtype}: gguf.quants can only quantize {', '.join(EXPORT_QTYPES)}")
    block_size, _ = gguf.GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    if w.shape[-1] % block_size:
        raise ValueError(f"cannot export {qtype}: row length {w.shape[-1]} is not a multiple of {block_size}")
    return gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), GGMLQuantizationType[qtype])


def _rope_theta(config: dict) -> float:
    params = config.get("rope_parameters") or {}
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def _add_model_metadata(writer: gguf.GGUFWriter, config: dict, arch: str) -> None:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(_rope_theta(config))
    if "head_dim" in config:  # what convert_hf_to_gguf does when the config states it
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config["vocab_size"])


def _add_tokenizer(writer: gguf.GGUFWriter, hf_dir: Path, config: dict) -> None:
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    vocab.update(special)
    tokens = [None] * config["vocab_size"]
    for text, index in vocab.items():
        tokens[index] = text
    for index, text in enumerate(tokens):
        if text is None:  # llama.cpp pads a short vocabulary the same way
            tokens[index] = f"[PAD{index}]"
    token_types = [
        gguf.TokenType.CONTROL if text in special else
        gguf.TokenType.UNUSED if text.startswith("[PAD") else gguf.TokenType.NORMAL
        for text in tokens
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    if config.get("pad_token_id") is not None:
        writer.add_pad_token_id(config["pad_token_id"])
    writer.add_add_bos_token(bool(tok_config.get("add_bos_token", False)))
    if tok_config.get("chat_template"):
        writer.add_chat_template(tok_config["chat_template"])


def _add_tensors(writer: gguf.GGUFWriter, hf_dir: Path, config: dict, arch: str, qtype: str) -> None:
    from safetensors.numpy import load_file

    weights = load_file(str(hf_dir / "model.safetensors"))
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    for hf_name, w in weights.items():
        w = w.astype(np.float32)
        if config.get("tie_word_embeddings") and hf_name == "lm_head.weight":
            continue  # llama.cpp omits output.weight when the head is the embedding
        if arch == "llama" and ".self_attn.q_proj." in hf_name:
            w = permute_qk(w, n_head)
        elif arch == "llama" and ".self_attn.k_proj." in hf_name:
            w = permute_qk(w, n_kv)
        name = gguf_tensor_name(hf_name)
        if w.ndim == 2 and qtype != "F32":
            stored = quantize_weight(w, qtype)
            raw_dtype = GGMLQuantizationType[qtype]
            writer.add_tensor(name, stored, raw_dtype=raw_dtype if stored.dtype == np.uint8 else None)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w))


def export_gguf(
    hf_dir: Path,
    out_path: Path,
    qtype: str = "F32",
    *,
    architecture: str | None = None,
    customize: Callable[[gguf.GGUFWriter], None] | None = None,
) -> Path:
    """Write the tiny HF model in ``hf_dir`` to ``out_path`` as a GGUF with 2-D weights in ``qtype``.

    ``architecture`` overrides the ``general.architecture`` written (to test unsupported ones);
    ``customize(writer)`` may add metadata (e.g. rope scaling keys) before the file is written.
    Raises ValueError for a qtype gguf.quants cannot write (the K-quants) or whose block size does not
    divide the rows.
    """
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    if qtype not in EXPORT_QTYPES:
        raise ValueError(f"cannot export {qtype}: gguf.quants can only quantize {', '.join(EXPORT_QTYPES)}")
    config = json.loads((hf_dir / "config.json").read_text())
    arch = config["model_type"]
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"export_gguf supports llama, qwen2, qwen3; not {arch!r}")
    writer = gguf.GGUFWriter(str(out_path), architecture or arch)
    _add_model_metadata(writer, config, arch)
    writer.add_file_type(gguf.LlamaFileType["ALL_F32" if qtype == "F32" else f"MOSTLY_{qtype}"])
    _add_tokenizer(writer, hf_dir, config)
    _add_tensors(writer, hf_dir, config, arch, qtype)
    if customize is not None:
        customize(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path
