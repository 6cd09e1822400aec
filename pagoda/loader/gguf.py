"""GGUF files: metadata → a Hugging-Face-style model directory, tensors → HF-named float32 tensors.

A GGUF (llama.cpp's format) carries the config, the tokenizer and the weights in one file, under
llama.cpp's names and conventions. pagoda's model code speaks Hugging Face, so this module
translates:

- ``convert_gguf_metadata`` writes ``config.json``, ``tokenizer.json``, ``tokenizer_config.json`` and
  ``generation_config.json`` (no weights) for a GGUF. The tokenizer goes through transformers' GGUF
  support, which is slow to import (~15 s), so ``load_gguf_model_dir`` caches the result under
  ``$PAGODA_HOME/converted/<key>/`` and later loads never import transformers.
- ``iter_gguf_weights`` yields ``(hf_name, float32 tensor)`` for every weight, undoing llama.cpp's
  storage conventions: Q/K row permutation (``llama`` only), ``1 + w`` norms (``gemma3``), and the
  reversed dimension order of GGUF shapes. With ``keep_quantized`` (``--quantization gguf``), Q4_0 and
  Q4_1 weights come as ``GGUFPackedWeight`` (the stored blocks) for the int4 kernel instead.

The file itself is read by ``gguf_file.read_gguf`` (metadata as Python values, capped; tensors as
views of a mapping).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from pagoda.home import pagoda_home
from pagoda.layers.quantization import PackedWeight
from pagoda.loader.gguf_file import (
    _PLAIN_DTYPES,
    GGUFFile,
    GGUFTensorInfo,
    _check_dequantizable,
    _short_float,
    read_gguf,
)
from pagoda.models.architectures import GGUF_ARCHITECTURES, GGUF_EXPERT_ARCHITECTURES

logger = logging.getLogger(__name__)

# general.architecture → (HF class, HF model_type): the table the model registry is built from
# (models/architectures.py). "llama" covers Llama 2/3, Mistral and SmolLM2.
_HF_ARCHITECTURES: dict[str, tuple[str, str]] = GGUF_ARCHITECTURES
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_HF_ARCHITECTURES)
# Mixture-of-experts families llama.cpp hard-codes whether the chosen experts' weights are
# renormalized for (build_moe_ffn's norm_w); pagoda also reads and writes {arch}.expert_weights_norm.
LLAMA_CPP_RENORMALIZES = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True, "olmoe": False}

# Bumped whenever the converted directory's contents change, so stale caches are not reused.
_CONVERTER_VERSION = 1

def _check_architecture(gf: GGUFFile) -> str:
    arch = gf.architecture
    if arch not in _HF_ARCHITECTURES:
        raise ValueError(f"{gf.path}: GGUF architecture {arch!r} is not supported; "
                         f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


# --------------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------------


def _required(gf: GGUFFile, key: str) -> Any:
    value = gf.arch_key(key)
    if value is None:
        raise ValueError(f"{gf.path}: metadata key {gf.architecture}.{key} is missing")
    return value


# The longest context a released model has is Llama 4 Scout's 10M tokens: a context_length past
# this is a corrupt or hostile file, refused before the rotary tables are sized from it.
MAX_CONTEXT_LENGTH = 1 << 24


def _size(gf: GGUFFile, key: str, maximum: int | None = None) -> int:
    """A required size: a positive integer (at most ``maximum``)."""
    value = _required(gf, key)
    if isinstance(value, list):
        raise ValueError(f"{gf.path}: per-layer values of {gf.architecture}.{key} are not supported")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (maximum and value > maximum):
        bound = f" of at most {maximum}" if maximum else ""
        raise ValueError(f"{gf.path}: metadata {gf.architecture}.{key} = {value!r} is not a positive integer{bound}")
    return value


def _check_sizes_match_tensors(gf: GGUFFile, config: Mapping[str, Any]) -> None:
    """The layer count and width the model is built with are those of the tensors in the file,
    so nothing is allocated for layers the file does not hold."""
    layers = {int(name.split(".")[1]) for name in gf.tensors if name.startswith("blk.") and name.split(".")[1].isdigit()}
    if layers != set(range(config["num_hidden_layers"])):
        raise ValueError(f"{gf.path}: metadata {gf.architecture}.block_count = {config['num_hidden_layers']}, but the "
                         f"file holds tensors for {len(layers)} layers (blk.0 ... blk.{max(layers, default=-1)})")
    embed = gf.tensors.get("token_embd.weight")
    if embed is not None and embed.shape[-1] != config["hidden_size"]:
        raise ValueError(f"{gf.path}: metadata {gf.architecture}.embedding_length = {config['hidden_size']}, but "
                         f"token_embd.weight has shape {list(embed.shape)}")


def _vocab_size(gf: GGUFFile) -> int:
    tokens = gf.metadata.get("tokenizer.ggml.tokens")
    embed = gf.tensors.get("token_embd.weight")
    if tokens is None:
        if embed is None:
            raise ValueError(f"{gf.path}: no token list and no token_embd.weight; cannot tell the vocab size")
        return embed.shape[0]
    if embed is not None and embed.shape[0] != len(tokens):
        logger.warning("%s: %d tokens but token_embd has %d rows; using the embedding's size",
                       gf.path, len(tokens), embed.shape[0])
        return embed.shape[0]
    return len(tokens)


def _llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any] | None:
    """Recover Llama-3 ``rope_scaling`` from llama.cpp's ``rope_freqs`` tensor.

    llama.cpp stores no llama3 rope keys; its converter bakes them into per-frequency divisors
    (1 for short wavelengths, ``factor`` for long ones, a smooth blend between). Only
    ``original_max_position_embeddings / {low,high}_freq_factor`` can be told apart, so we fix
    ``original_max_position_embeddings`` at Llama 3's 8192 and fit the two factors; the inverse
    frequencies HF computes from them are the same ones llama.cpp uses.
    """
    factors = factors.astype(np.float64)
    factor = float(factors.max())
    if factor <= 1.0:
        return None
    original = 8192
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    smooth = (factors > 1.0 + 1e-6) & (factors < factor - 1e-6)
    low, high = 1.0, 4.0  # Llama 3.1/3.2's values, used when too few points lie in the blend
    if smooth.sum() >= 2:
        s = (1 / factors[smooth] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelen[smooth], s, 1)
        span = original / slope
        low = round(float(-intercept * span), 4)
        high = round(float(low + span), 4)
    scaling = {"rope_type": "llama3", "factor": _short_float(factor), "low_freq_factor": low,
               "high_freq_factor": high, "original_max_position_embeddings": original}
    if not np.allclose(_llama3_factors(scaling, theta, head_dim), factors, rtol=1e-3):
        logger.warning("rope_freqs does not match a llama3 rope scaling; using the closest fit %s", scaling)
    return scaling


def _llama3_factors(scaling: Mapping[str, Any], theta: float, head_dim: int) -> np.ndarray:
    """llama.cpp's llama3 ``rope_freqs`` for a scaling dict (the forward of ``_llama3_rope_scaling``)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    smooth = (original / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, blended))


def _rope_scaling(gf: GGUFFile, theta: float, head_dim: int) -> dict[str, Any] | None:
    """HF ``rope_scaling`` from ``{arch}.rope.scaling.*`` (or llama3's ``rope_freqs`` tensor)."""
    kind = gf.arch_key("rope.scaling.type")
    factor = gf.arch_key("rope.scaling.factor", gf.arch_key("rope.scale_linear"))
    if kind is None and factor is not None:
        kind = "linear"  # older files only had rope.scale_linear
    if kind == "linear" and factor not in (None, 1.0):
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": factor}
        optional = {"original_max_position_embeddings": "rope.scaling.original_context_length",
                    "beta_fast": "rope.scaling.yarn_beta_fast", "beta_slow": "rope.scaling.yarn_beta_slow"}
        for hf_key, gguf_key in optional.items():
            if gf.arch_key(gguf_key) is not None:
                scaling[hf_key] = gf.arch_key(gguf_key)
        return scaling
    if kind not in (None, "none", "linear"):
        logger.warning("%s: rope scaling type %r is not converted; the model will run unscaled", gf.path, kind)
    freqs = gf.tensors.get("rope_freqs.weight")
    if freqs is not None and gf.architecture == "llama":
        return _llama3_rope_scaling(gf.dequantized(freqs).reshape(-1), theta, head_dim)
    return None


def _special_token_ids(gf: GGUFFile) -> dict[str, Any]:
    md = gf.metadata
    return {
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": md.get("tokenizer.ggml.padding_token_id"),
    }


def _hf_architecture(gf: GGUFFile) -> tuple[str, str]:
    """(HF class, model_type) of the file: Mixtral is "llama" with experts."""
    arch = gf.architecture
    if (gf.arch_key("expert_count") or 0) > 0 and arch in GGUF_EXPERT_ARCHITECTURES:
        return GGUF_EXPERT_ARCHITECTURES[arch]
    return _HF_ARCHITECTURES[arch]


def _base_config(gf: GGUFFile, arch: str) -> dict[str, Any]:
    n_heads = _size(gf, "attention.head_count")
    n_kv_heads = gf.arch_key("attention.head_count_kv", n_heads)
    if isinstance(n_kv_heads, list):
        raise ValueError(f"{gf.path}: per-layer head counts are not supported")
    hidden = _size(gf, "embedding_length")
    head_dim = gf.arch_key("attention.key_length") or hidden // n_heads
    theta = gf.arch_key("rope.freq_base", 10000.0)
    hf_class, model_type = _hf_architecture(gf)
    config: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": _required(gf, "feed_forward_length"),
        "num_hidden_layers": _size(gf, "block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _required(gf, "attention.layer_norm_rms_epsilon"),
        "rope_theta": theta,
        "max_position_embeddings": _size(gf, "context_length", MAX_CONTEXT_LENGTH),
        "vocab_size": _vocab_size(gf),
        # llama.cpp writes output.weight only when the LM head is not the embedding.
        "tie_word_embeddings": "output.weight" not in gf.tensors,
        "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in gf.tensors,
        "mlp_bias": False,
        **_special_token_ids(gf),
    }
    scaling = _rope_scaling(gf, theta, head_dim)
    if scaling is not None:
        config["rope_scaling"] = scaling
    # transformers >= 5 reads rope_parameters; older readers (and most hub configs) use the two above.
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": theta, **(scaling or {})}
    if arch in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False
    return config


def _gemma3_config(gf: GGUFFile, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 settings llama.cpp hard-codes or stores under its own names (Gemma3TextConfig names)."""
    n_layers = config["num_hidden_layers"]
    pattern = gf.arch_key("attention.sliding_window_pattern", 6)
    if not isinstance(pattern, int):
        raise ValueError(f"{gf.path}: a per-layer sliding_window_pattern is not supported")
    # llama.cpp: 1/sqrt(hidden/heads) for the 27B (62 layers), 1/sqrt(head_dim) otherwise.
    scalar = config["hidden_size"] // config["num_attention_heads"] if n_layers == 62 else config["head_dim"]
    local_theta = gf.arch_key("rope.freq_base_swa", 10000.0)  # llama.cpp's default for gemma3
    full_rope = config.pop("rope_parameters")
    config.pop("hidden_act")
    config.update({
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "sliding_window": gf.arch_key("attention.sliding_window", 4096),
        "sliding_window_pattern": pattern,
        "layer_types": ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)],
        "rope_local_base_freq": local_theta,
        "rope_parameters": {"full_attention": full_rope,
                            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}},
        "final_logit_softcapping": gf.arch_key("final_logit_softcapping"),
        "attn_logit_softcapping": gf.arch_key("attn_logit_softcapping"),
        "use_bidirectional_attention": False,
    })
    return config


def _moe_config(gf: GGUFFile, config: dict[str, Any]) -> dict[str, Any]:
    """Mixture-of-experts settings (transformers' names for the family)."""
    model_type = config["model_type"]
    experts = _required(gf, "expert_count")
    config.update(num_experts_per_tok=_required(gf, "expert_used_count"),
                  norm_topk_prob=bool(gf.arch_key("expert_weights_norm", LLAMA_CPP_RENORMALIZES[model_type])))
    config["num_local_experts" if model_type == "mixtral" else "num_experts"] = experts
    if model_type in ("qwen2_moe", "qwen3_moe"):
        config["moe_intermediate_size"] = gf.arch_key("expert_feed_forward_length") or config["intermediate_size"]
        config.update(decoder_sparse_step=1, mlp_only_layers=[])
    if model_type == "qwen2_moe":
        config["shared_expert_intermediate_size"] = gf.arch_key("expert_shared_feed_forward_length", 0)
        config["qkv_bias"] = config.pop("attention_bias")
    if model_type == "olmoe":
        config["clip_qkv"] = gf.arch_key("attention.clamp_kqv")
    return config


def _phi3_config(gf: GGUFFile, config: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's sliding window and LongRoPE (its factors are tensors in the file)."""
    config["sliding_window"] = gf.arch_key("attention.sliding_window") or None
    original = gf.arch_key("rope.scaling.original_context_length")
    if original:
        config["original_max_position_embeddings"] = original
    factors = [gf.tensors.get(f"rope_factors_{kind}.weight") for kind in ("short", "long")]
    if all(f is not None for f in factors):
        short, long = ([float(x) for x in gf.dequantized(f).reshape(-1)] for f in factors)
        scaling = {"rope_type": "longrope", "short_factor": short, "long_factor": long,
                   "original_max_position_embeddings": original or config["max_position_embeddings"]}
        if gf.arch_key("rope.scaling.attn_factor") is not None:
            scaling["attention_factor"] = gf.arch_key("rope.scaling.attn_factor")
        config["rope_scaling"] = scaling
        config["rope_parameters"] = {"rope_theta": config["rope_theta"], **scaling}
    return config


def gguf_to_hf_config(gf: GGUFFile) -> dict[str, Any]:
    """The HF ``config.json`` contents for a parsed GGUF."""
    arch = _check_architecture(gf)
    config = _base_config(gf, arch)
    _check_sizes_match_tensors(gf, config)
    if arch == "gemma3":
        config = _gemma3_config(gf, config)
    if config["model_type"] in LLAMA_CPP_RENORMALIZES:
        config = _moe_config(gf, config)
    if arch == "phi3":
        config = _phi3_config(gf, config)
    return config


# --------------------------------------------------------------------------------------------------
# tokenizer.json / tokenizer_config.json / generation_config.json
# --------------------------------------------------------------------------------------------------

# Token texts llama.cpp treats as end-of-generation besides the eos id (llama-vocab.cpp).
_END_OF_GENERATION_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                            "<EOT>", "<|end_of_text|>", "<｜end▁of▁sentence｜>")
_CONTROL_TOKEN = 3


def _end_of_generation_ids(gf: GGUFFile) -> list[int]:
    """eos first, then eot/eom and the control tokens llama.cpp also stops on."""
    md = gf.metadata
    ids = [md.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    tokens, types = md.get("tokenizer.ggml.tokens") or [], md.get("tokenizer.ggml.token_type") or []
    ids += [i for i, (text, kind) in enumerate(zip(tokens, types))
            if kind == _CONTROL_TOKEN and text in _END_OF_GENERATION_TEXTS]
    return list(dict.fromkeys(i for i in ids if i is not None))


def _pre_tokenizer_fixup(pre: str | None) -> Any:
    """A pre-tokenizer for ``tokenizer.ggml.pre`` values transformers does not map (it then falls
    back to plain GPT-2 byte-level splitting), or None to keep what transformers built.

    llama.cpp's "smollm", "starcoder" and "refact" split every digit apart first, then apply the GPT-2
    regex: exactly HF's ``Digits(individual_digits=True)`` + ``ByteLevel(use_regex=True)``, which is
    what SmolLM2's own tokenizer.json says.
    """
    from tokenizers import pre_tokenizers  # deferred: tokenizers loads on first use

    if pre in ("smollm", "starcoder", "refact"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ])
    return None


def _bos_eos_post_processor(bos: str | None, eos: str | None, vocab: Mapping[str, int]) -> Any:
    """A TemplateProcessing that adds ``bos``/``eos`` (either may be None) around each sequence."""
    from tokenizers import processors  # deferred: tokenizers loads on first use

    before = [bos] if bos else []
    after = [eos] if eos else []
    single = before + ["$A:0"] + after
    pair = single + [f"{t}:1" for t in before] + ["$B:1"] + [f"{t}:1" for t in after]
    special = [(t, vocab[t]) for t in dict.fromkeys(before + after)]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _convert_tokenizer_with_transformers(gguf_path: Path, model_type: str) -> str:
    """transformers' GGUF tokenizer conversion, as a tokenizer.json string (slow: imports transformers).

    ``model_type`` (the converted config's) names the tokenizer class where transformers knows it
    (Gemma 3's class adds its ``<mask>`` token). Where it knows none (llama, mistral, SmolLM2) the
    tokenizer fields alone are converted: AutoTokenizer would read the model's config from the
    file to find a class, parsing every field in full, one element at a time (SmolLM2: 11 s where
    the fields take 1 s; a 500k-item array a hostile 4 MB file adds: ~800 MiB), and the result is
    the same tokenizer.json."""
    from transformers import AutoTokenizer  # transformers loads on first use
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES  # transformers loads on first use

    if model_type not in TOKENIZER_MAPPING_NAMES:
        return _tokenizer_from_fields(gguf_path)
    by_type = {"tokenizer_type": model_type}

    with tempfile.TemporaryDirectory(prefix="pagoda-gguf-tok-") as tmp:
        # A directory holding only the GGUF, so nothing else next to the file can be picked up.
        link = Path(tmp) / gguf_path.name
        target = gguf_path.resolve()
        if not target.exists():  # /proc/self/fd/N of a GGUF decrypted into memory: link to the fd itself
            target = gguf_path.absolute()
        try:
            link.symlink_to(target)
        except OSError:
            shutil.copyfile(gguf_path, link)
        try:
            tok = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf_path.name, **by_type)
        except Exception as exc:
            if "is not supported" in str(exc):  # an architecture transformers cannot load (olmoe)
                return _tokenizer_from_fields(link)
            raise ValueError(f"{gguf_path}: could not convert the GGUF tokenizer: {exc}") from exc
    return tok.backend_tokenizer.to_str()


def _tokenizer_from_fields(path: Path) -> str:
    """transformers' converter of a GGUF's tokenizer fields alone, for a file whose architecture
    transformers does not load (AutoTokenizer reads the model's config too)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (  # transformers loads on first use
        convert_gguf_tokenizer,
        get_gguf_tokenizer,
    )

    try:
        architecture, fields, _ = get_gguf_tokenizer(str(path))
        backend, _ = convert_gguf_tokenizer(architecture, fields)
    except Exception as exc:
        raise ValueError(f"{path}: could not convert the GGUF tokenizer: {exc}") from exc
    return backend.to_str()


def _tokenizer_settings(gf: GGUFFile) -> dict[str, Any]:
    md = gf.metadata
    tokens = md.get("tokenizer.ggml.tokens") or []

    def text(key: str) -> str | None:
        index = md.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    # llama.cpp adds BOS to sentencepiece ("llama") vocabularies unless the file says otherwise.
    add_bos_default = md.get("tokenizer.ggml.model") == "llama"
    return {
        "bos_token": text("bos"),
        "eos_token": text("eos"),
        "pad_token": text("padding"),
        "unk_token": text("unknown"),
        "add_bos_token": bool(md.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        "add_eos_token": bool(md.get("tokenizer.ggml.add_eos_token", False)),
    }


def _write_tokenizer(gf: GGUFFile, out_dir: Path, config: Mapping[str, Any]) -> None:
    from tokenizers import Tokenizer  # deferred: tokenizers loads on first use

    settings = _tokenizer_settings(gf)
    tokenizer = Tokenizer.from_str(_convert_tokenizer_with_transformers(gf.path, config["model_type"]))
    pre = gf.metadata.get("tokenizer.ggml.pre")
    fixed = _pre_tokenizer_fixup(pre)
    if fixed is not None:
        logger.info("%s: tokenizer.ggml.pre=%r: using digit-splitting byte-level pre-tokenizer", gf.path, pre)
        tokenizer.pre_tokenizer = fixed
    # Make tokenizer.json's own special-token handling match add_bos/add_eos, so that a plain
    # `Tokenizer.from_file(...).encode(text)` gives what llama.cpp would.
    bos = settings["bos_token"] if settings["add_bos_token"] else None
    eos = settings["eos_token"] if settings["add_eos_token"] else None
    if bos or eos:
        tokenizer.post_processor = _bos_eos_post_processor(bos, eos, tokenizer.get_vocab(with_added_tokens=True))
    tokenizer.save(str(out_dir / "tokenizer.json"))

    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **settings,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    chat_template = gf.metadata.get("tokenizer.chat_template")
    if chat_template:
        tokenizer_config["chat_template"] = chat_template
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf_metadata(gguf_path: Path, out_dir: Path) -> Path:
    """Write a Hugging-Face-style metadata directory (config, tokenizer, generation config; no weights)
    for ``gguf_path`` into ``out_dir`` and return ``out_dir``.

    Imports transformers for the tokenizer (slow); use ``load_gguf_model_dir`` for a cached copy.
    Raises ValueError for an invalid/truncated file or an unsupported architecture.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    gf = read_gguf(gguf_path)
    config = gguf_to_hf_config(gf)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "config.json", config)
    _write_tokenizer(gf, out_dir, config)
    eos_ids = _end_of_generation_ids(gf)
    generation_config = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        "pad_token_id": config["pad_token_id"],
    }
    _write_json(out_dir / "generation_config.json", generation_config)
    return out_dir


def _cache_key(gguf_path: Path) -> str:
    resolved = gguf_path.resolve()
    stat = resolved.stat()
    ident = f"{resolved}|{stat.st_size}|{stat.st_mtime_ns}|v{_CONVERTER_VERSION}"
    return hashlib.sha1(ident.encode()).hexdigest()


def load_gguf_model_dir(gguf_path: Path) -> Path:
    """The converted metadata directory for ``gguf_path``, from ``$PAGODA_HOME/converted/<key>/``.

    Converts on first use (into a temporary directory, then renamed into place, so an interrupted
    conversion never leaves a half-written cache entry). Later calls only stat the file.
    """
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    root = pagoda_home() / "converted"
    final = root / _cache_key(gguf_path)
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        convert_gguf_metadata(gguf_path, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a concurrent conversion that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# --------------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------------

_TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 norms around both sublayers: llama.cpp's ffn_norm is the pre-FFN one there.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Mixture of experts (Qwen-MoE / OLMoE checkpoint names); ``*`` is the expert: llama.cpp stacks
# the experts of a layer into one tensor [experts, rows, columns].
_MOE_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.*.gate_proj",
    "ffn_up_exps": "mlp.experts.*.up_proj",
    "ffn_down_exps": "mlp.experts.*.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Mixtral's checkpoint names: block_sparse_moe, w1 (gate), w3 (up), w2 (down)
_MIXTRAL_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_gate_inp": "block_sparse_moe.gate",
    "ffn_gate_exps": "block_sparse_moe.experts.*.w1",
    "ffn_up_exps": "block_sparse_moe.experts.*.w3",
    "ffn_down_exps": "block_sparse_moe.experts.*.w2",
}
# Phi-3 keeps q/k/v and gate/up fused; llama.cpp's ffn_up is the fused gate/up.
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Tensors that only feed the config (llama3 rope factors are folded into rope_scaling, Phi-3's
# LongRoPE factors into its rope_parameters).
_CONFIG_ONLY_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def _layer_names(arch: str, model_type: str | None) -> dict[str, str]:
    if arch == "gemma3":
        return _GEMMA3_LAYER_NAMES
    if arch == "phi3":
        return _PHI3_LAYER_NAMES
    if model_type == "mixtral":
        return _MIXTRAL_LAYER_NAMES
    return _MOE_LAYER_NAMES if arch in ("qwen2moe", "qwen3moe", "olmoe") else _LAYER_NAMES


def gguf_to_hf_name(name: str, arch: str, model_type: str | None = None) -> str | None:
    """The HF parameter name for a GGUF tensor name, or None if it has none. A stacked experts
    tensor's name has ``*`` for the expert (``model.layers.0.mlp.experts.*.up_proj.weight``);
    ``model_type`` tells Mixtral (written as "llama") apart."""
    stem, dot, suffix = name.rpartition(".")
    if not dot or suffix not in ("weight", "bias"):
        return None
    if stem in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    hf = _layer_names(arch, model_type).get(parts[2])
    return f"model.layers.{parts[1]}.{hf}.{suffix}" if hf else None


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's q/k permutation.

    llama.cpp's converter stores ``w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2)``
    so that each head's rotary pairs are adjacent (GPT-J style) rather than split in halves (HF's
    rotate_half). Swapping the same axes back restores HF's row order.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _expected_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF shape per parameter-name suffix (after ``model.layers.N.``), for shape checks."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    vocab = config["vocab_size"]
    q, kv = heads * head_dim, kv_heads * head_dim
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    expert_inter = config.get("moe_intermediate_size") or inter
    shared = config.get("shared_expert_intermediate_size") or 0
    norm = (q, kv) if config.get("model_type") == "olmoe" else (head_dim, head_dim)  # OLMoE: the whole projection
    moe = {  # stacked experts as stored: [experts, rows, columns]
        f"{block}.experts.*.{name}.weight": (experts, *shape)
        for block, names in (("mlp", ("gate_proj", "up_proj", "down_proj")), ("block_sparse_moe", ("w1", "w3", "w2")))
        for name, shape in zip(names, ((expert_inter, hidden), (expert_inter, hidden), (hidden, expert_inter)))
    }
    return {
        **moe, "mlp.gate.weight": (experts, hidden), "block_sparse_moe.gate.weight": (experts, hidden),
        "mlp.shared_expert.gate_proj.weight": (shared, hidden), "mlp.shared_expert.up_proj.weight": (shared, hidden),
        "mlp.shared_expert.down_proj.weight": (hidden, shared), "mlp.shared_expert_gate.weight": (hidden,),
        "self_attn.qkv_proj.weight": (q + 2 * kv, hidden), "mlp.gate_up_proj.weight": (2 * inter, hidden),
        "model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden), "model.norm.weight": (hidden,),
        "self_attn.q_proj.weight": (q, hidden), "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, q),
        "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
        "self_attn.q_norm.weight": norm[:1], "self_attn.k_norm.weight": norm[1:],
        "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
        "pre_feedforward_layernorm.weight": (hidden,), "post_feedforward_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }


def _shape_key(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        return hf_name.split(".", 3)[3]
    return hf_name


def _plan_weights(gf: GGUFFile, config: Mapping[str, Any]) -> list[tuple[GGUFTensorInfo, str]]:
    """Map and check every tensor before any is dequantized, so a bad file fails fast."""
    arch = gf.architecture
    expected = _expected_shapes(config)
    n_layers = config["num_hidden_layers"]
    plan = []
    for info in gf.tensors.values():
        if info.name in _CONFIG_ONLY_TENSORS:
            continue
        hf_name = gguf_to_hf_name(info.name, arch, config.get("model_type"))
        if hf_name is None:
            logger.warning("%s: skipping tensor %r (no Hugging Face counterpart)", gf.path, info.name)
            continue
        if hf_name.startswith("model.layers.") and int(hf_name.split(".")[2]) >= n_layers:
            raise ValueError(f"{gf.path}: tensor {info.name!r} is beyond num_hidden_layers={n_layers}")
        want = expected.get(_shape_key(hf_name))
        if want is not None and info.shape != want:
            raise ValueError(f"{gf.path}: tensor {info.name!r} has shape {list(info.shape)}, but the config "
                             f"implies {list(want)} for {hf_name}")
        _check_dequantizable(info)
        plan.append((info, hf_name))
    return plan


def _check_config_matches(gf: GGUFFile, config: Mapping[str, Any]) -> None:
    model_type = config.get("model_type")
    expected = _hf_architecture(gf)[1]
    if model_type is not None and model_type != expected:
        raise ValueError(f"{gf.path}: the GGUF is {gf.architecture!r} (HF model_type {expected!r}), but the "
                         f"config says model_type {model_type!r}")


# GGUF types kept as stored under ``--quantization gguf``: ggml's blocks of 32, which pagoda's block
# kernels multiply as they are (pagoda/layers/ggml_blocks.py). Without those kernels, Q4_0 / Q4_1
# map exactly onto torch's int4 kernel groups, and Q8_0 is dequantized like every other type.
# The super-block formats (K-quants, IQ4) and Q5_0 / Q5_1 are repacked for pagoda's kernels
# (layers/superblocks.py), F16 / BF16 weights too (layers/half_weights.py).
KEPT_QUANTIZED_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0,
                        GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1,
                        GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
                        GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
                        GGMLQuantizationType.IQ4_NL, GGMLQuantizationType.IQ4_XS)


class GGUFPackedWeight(PackedWeight):
    """A weight of a ``KEPT_QUANTIZED_TYPES`` type as stored: ``blocks`` is [rows, bytes per row]
    (a view of the file). The super-block formats' layouts are in pagoda/csrc/superblock_formats.h.

    Block layout (ggml-common.h): fp16 ``d``, for Q4_1 fp16 ``m``, then the codes: for the 4-bit
    types 16 bytes, element j in the low nibble of byte j and element j + 16 in the high nibble;
    for Q8_0 32 int8. ``Q4_0: w = d * (q - 8)``; ``Q4_1: w = d * q + m``; ``Q8_0: w = d * q``.
    """

    def __init__(self, ggml_type: GGMLQuantizationType, blocks: np.ndarray, shape: tuple[int, ...]) -> None:
        if ggml_type not in KEPT_QUANTIZED_TYPES:
            raise ValueError(f"{ggml_type.name} is not kept quantized (only {[t.name for t in KEPT_QUANTIZED_TYPES]})")
        self.ggml_type, self.blocks, self.shape = ggml_type, blocks, tuple(shape)
        self.int4_exact = ggml_type in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)
        self.ggml_block_type = int(ggml_type)  # the GGMLQuantizationType values ggml_blocks uses

    def rows(self, start: int, stop: int) -> GGUFPackedWeight:
        return GGUFPackedWeight(self.ggml_type, self.blocks[start:stop], (stop - start, *self.shape[1:]))

    def ggml_blocks(self) -> torch.Tensor:
        """A copy of the stored rows (the file mapping is closed after loading); F16 / BF16 as
        [rows, columns] int16 holding the stored bits."""
        if self.ggml_type in (GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
            return torch.from_numpy(np.array(self.blocks).view(np.int16).reshape(self.shape))
        return torch.from_numpy(np.array(self.blocks, dtype=np.uint8).reshape(self.shape[0], -1))

    def dequantize(self) -> torch.Tensor:
        w = np.asarray(dequantize(np.ascontiguousarray(self.blocks), self.ggml_type), dtype=np.float32)
        return torch.from_numpy(w.reshape(self.shape))

    def int4_groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.int4_exact:
            return super().int4_groups()
        rows, cols = self.shape
        block_size, type_size = GGML_QUANT_SIZES[self.ggml_type]
        blocks = np.ascontiguousarray(self.blocks).reshape(rows, cols // block_size, type_size)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        header = 2 if self.ggml_type == GGMLQuantizationType.Q4_0 else 4
        qs = blocks[..., header:]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)
        if self.ggml_type == GGMLQuantizationType.Q4_0:
            zero = np.zeros_like(d)  # d * (q - 8)
        else:
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            zero = m + np.float32(8.0) * d  # d * q + m == d * (q - 8) + (m + 8 d)
        return torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(zero)


def iter_gguf_weights(gguf_path: Path, config: Mapping[str, Any], *, keep_quantized: bool = False,
                      narrow: WeightSlicer | None = None) -> Iterator[tuple[str, torch.Tensor | GGUFPackedWeight]]:
    """Yield ``(hf_parameter_name, float32 tensor in HF shape)`` for every weight in the GGUF.

    ``config`` is the HF config dict (as ``convert_gguf_metadata`` writes it); head counts come from
    it. With ``keep_quantized``, 2-D weights of a ``KEPT_QUANTIZED_TYPES`` type come as a
    ``GGUFPackedWeight`` (the stored blocks, rows un-permuted like the float path) instead.
    Raises ValueError, before yielding anything, for an invalid/truncated file, an unsupported
    architecture, a tensor type pagoda cannot dequantize, or a shape that disagrees with the config.

    ``narrow`` (tensor parallelism) gives, per HF name and shape, the slice this rank holds: only
    that part is read and dequantized, and a kept-quantized weight is cut along whole blocks.
    """
    gf = read_gguf(gguf_path)
    arch = _check_architecture(gf)
    _check_config_matches(gf, config)
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    for stacked, stacked_name in _plan_weights(gf, config):
        for info, hf_name in _unstacked(stacked, stacked_name):
            packed = keep_quantized and info.ggml_type in KEPT_QUANTIZED_TYPES and len(info.shape) == 2
            cut = narrow(hf_name, info.shape) if narrow is not None else None
            w, shape = _read_slice(gf, info, cut, dequantize_it=not packed)
            # Row permutations act on whole rows (within a head), so they apply to stored blocks as
            # to floats, and to a slice of whole heads with the slice's head count.
            if arch == "llama" and ".self_attn.q_proj." in hf_name:
                w = _unpermute_rows(w, heads * shape[0] // info.shape[0])
            elif arch == "llama" and ".self_attn.k_proj." in hf_name:
                w = _unpermute_rows(w, kv_heads * shape[0] // info.shape[0])
            elif arch == "gemma3" and hf_name.endswith("norm.weight"):
                # llama.cpp's converter stores Gemma's RMSNorm weight as (1 + w); HF keeps w.
                w = w - 1.0
            if packed:
                yield hf_name, GGUFPackedWeight(info.ggml_type, w, shape)
                continue
            w = np.ascontiguousarray(w, dtype=np.float32)
            if not w.flags.writeable:  # a view of the read-only mapping (F32 tensors)
                w = w.copy()
            if hf_name.endswith(".shared_expert_gate.weight"):
                w = w.reshape(1, -1)  # llama.cpp stores the [1, hidden] gate as [hidden]
            yield hf_name, torch.from_numpy(w)


def _unstacked(info: GGUFTensorInfo, hf_name: str) -> Iterator[tuple[GGUFTensorInfo, str]]:
    """A tensor of stacked experts (``*`` in its name) → one 2-D tensor per expert (where it lies
    in the file); any other tensor as it is."""
    if "*" not in hf_name:
        yield info, hf_name
        return
    experts = info.shape[0]
    size = info.nbytes // experts
    for e in range(experts):
        yield (GGUFTensorInfo(f"{info.name}[{e}]", info.ggml_type, info.shape[1:], info.offset + e * size, size),
               hf_name.replace("*", str(e)))


# (HF name, full shape) → (dim, start, length) of the part to read, or None for all of it
WeightSlicer = Callable[[str, tuple[int, ...]], "tuple[int, int, int] | None"]


def _read_slice(gf: GGUFFile, info: GGUFTensorInfo, cut: tuple[int, int, int] | None,
                dequantize_it: bool) -> tuple[np.ndarray, tuple[int, ...]]:
    """The tensor's ``cut`` (all of it for None): stored blocks, or float32 when ``dequantize_it``.
    A cut along the last dimension of a block type must fall on block boundaries."""
    shape = list(info.shape)
    data = gf.stored_array(info)
    if cut is not None:
        dim, start, length = cut
        dim %= len(shape)
        index = [slice(None)] * data.ndim
        if dim == len(shape) - 1 and info.ggml_type not in _PLAIN_DTYPES:
            block, type_size = GGML_QUANT_SIZES[info.ggml_type]
            if start % block or length % block:
                raise ValueError(f"{gf.path}: tensor {info.name!r} ({info.ggml_type.name}) cannot be split at "
                                 f"column {start}..{start + length}: not a multiple of its {block}-element blocks")
            index[dim] = slice(start // block * type_size, (start + length) // block * type_size)
        else:
            index[dim] = slice(start, start + length)
        data = data[tuple(index)]
        shape[dim] = length
    if not dequantize_it:
        return data, tuple(shape)
    _check_dequantizable(info)
    if info.ggml_type == GGMLQuantizationType.F64:
        return data.astype(np.float32), tuple(shape)
    return np.asarray(dequantize(np.ascontiguousarray(data), info.ggml_type), dtype=np.float32).reshape(shape), tuple(shape)
