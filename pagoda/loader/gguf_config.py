"""GGUF metadata → the Hugging Face ``config.json`` of the model (``gguf_to_hf_config``).

llama.cpp stores the config under its own keys (``{arch}.block_count``, ``{arch}.rope.*``) and
hard-codes some settings per architecture; this module maps them onto transformers' names for
each architecture pagoda reads (models/architectures.py's table): the sizes (checked against the
tensors the file holds), rope scaling (llama3's recovered from the ``rope_freqs`` tensor), and
Gemma 3's, the mixture-of-experts families' and Phi-3's own settings.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from pagoda.loader.gguf_file import GGUFFile, _short_float
from pagoda.models.architectures import GGUF_ARCHITECTURES, GGUF_EXPERT_ARCHITECTURES

logger = logging.getLogger(__name__)

# general.architecture → (HF class, HF model_type): the table models/model_classes.py is built from
# (models/architectures.py). "llama" covers Llama 2/3, Mistral and SmolLM2.
_HF_ARCHITECTURES: dict[str, tuple[str, str]] = GGUF_ARCHITECTURES
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_HF_ARCHITECTURES)
# Mixture-of-experts families llama.cpp hard-codes whether the chosen experts' weights are
# renormalized for (build_moe_ffn's norm_w); pagoda also reads and writes {arch}.expert_weights_norm.
LLAMA_CPP_RENORMALIZES = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True, "olmoe": False}


def check_architecture(gf: GGUFFile) -> str:
    arch = gf.architecture
    if arch not in _HF_ARCHITECTURES:
        raise ValueError(f"{gf.path}: GGUF architecture {arch!r} is not supported; "
                         f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


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


def hf_architecture(gf: GGUFFile) -> tuple[str, str]:
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
    hf_class, model_type = hf_architecture(gf)
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
    arch = check_architecture(gf)
    config = _base_config(gf, arch)
    _check_sizes_match_tensors(gf, config)
    if arch == "gemma3":
        config = _gemma3_config(gf, config)
    if config["model_type"] in LLAMA_CPP_RENORMALIZES:
        config = _moe_config(gf, config)
    if arch == "phi3":
        config = _phi3_config(gf, config)
    return config

