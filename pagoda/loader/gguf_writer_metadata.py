"""The model metadata of a GGUF pagoda writes (gguf_writer.py), under llama.cpp's keys: context,
sizes, heads, norm epsilon, rope base and scaling, and what each architecture's llama.cpp
converter writes beyond those (Gemma 3's sliding window and local rope base, Phi-3's LongRoPE
settings, the mixture-of-experts counts). A model that departs from what llama.cpp assumes
rather than reads is refused, not written as a file that would run differently.
"""

from __future__ import annotations

import logging

from pagoda.models.config import layer_windows, rope_scaling

logger = logging.getLogger(__name__)

_MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def _rope_theta(config: dict) -> float:
    params = config.get("rope_parameters") or {}
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def add_model_metadata(writer, config: dict, arch: str, name: str) -> None:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_name(name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads") or config["num_attention_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if arch != "gemma3":  # Gemma 3's global and local bases: _add_gemma3_metadata
        writer.add_rope_freq_base(_rope_theta(config))
    if "head_dim" in config:  # what convert_hf_to_gguf does when the config states it
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if arch == "gemma3":
        _add_gemma3_metadata(writer, config, head_dim)
    if arch == "phi3":
        _add_phi3_metadata(writer, config, head_dim)
    if config.get("model_type") in _MOE_MODEL_TYPES:
        _add_moe_metadata(writer, config)
    writer.add_vocab_size(config["vocab_size"])


def _add_moe_metadata(writer, config: dict) -> None:
    """Expert counts and sizes under llama.cpp's keys. llama.cpp runs every layer sparse and
    hard-codes each family's renormalization: a model that departs is refused (dense layers) or
    written with a warning (``expert_weights_norm`` says what pagoda does; llama.cpp may not read it)."""
    from pagoda.loader.gguf_config import LLAMA_CPP_RENORMALIZES  # deferred: loads gguf
    from pagoda.models.moe import num_experts, sparse_layers  # deferred: loads torch

    model_type = config["model_type"]
    if not all(sparse_layers(config, config["num_hidden_layers"])):
        raise ValueError("cannot write this model to GGUF: llama.cpp runs every layer as experts "
                         "(mlp_only_layers / decoder_sparse_step make some dense)")
    writer.add_expert_count(num_experts(config))
    writer.add_expert_used_count(config["num_experts_per_tok"])
    renormalize = True if model_type == "mixtral" else bool(config.get("norm_topk_prob", False))
    writer.add_expert_weights_norm(renormalize)
    if renormalize != LLAMA_CPP_RENORMALIZES[model_type]:
        logger.warning("%s with norm_topk_prob=%s: pagoda reads it from the file, llama.cpp assumes %s",
                       model_type, renormalize, LLAMA_CPP_RENORMALIZES[model_type])
    if config.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if config.get("clip_qkv") is not None:
        writer.add_clamp_kqv(float(config["clip_qkv"]))


def _add_phi3_metadata(writer, config: dict, head_dim: int) -> None:
    """What llama.cpp's Phi-3 converter writes: the sliding window (0: none), the rotary dimension,
    and for LongRoPE the original context and attention factor (the factors are tensors)."""
    from pagoda.layers.rotary import longrope_attention_factor  # deferred: loads torch

    writer.add_rope_dimension_count(head_dim)
    writer.add_sliding_window(int(config.get("sliding_window") or 0))
    scaling = rope_scaling(config)
    if scaling is None:
        return
    if scaling["rope_type"] != "longrope":
        raise ValueError(f"cannot write this Phi-3 to GGUF: rope scaling {scaling['rope_type']!r} (longrope only)")
    writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    writer.add_rope_scaling_attn_factors(longrope_attention_factor(scaling))


def _add_gemma3_metadata(writer, config: dict, head_dim: int) -> None:
    """What llama.cpp's Gemma 3 converter writes beyond the common keys. llama.cpp assumes some
    settings rather than storing them; a model that departs from those is refused, not written
    as a file that would run differently."""
    from pagoda.models.gemma3 import rope_settings  # deferred: loads torch

    n_layers = config["num_hidden_layers"]
    (theta, scaling), (local_theta, local_scaling) = rope_settings(config)
    scalar = config.get("query_pre_attn_scalar") or head_dim
    assumed = config["hidden_size"] // config["num_attention_heads"] if n_layers == 62 else head_dim
    problems = []
    if scalar != assumed:
        problems.append(f"query_pre_attn_scalar {scalar} (llama.cpp assumes {assumed})")
    if local_scaling is not None:
        problems.append("rope scaling on the local layers")
    if config.get("attn_logit_softcapping") is not None or config.get("use_bidirectional_attention"):
        problems.append("attention soft-capping or bidirectional attention")
    window = config.get("sliding_window") or 0
    windows = layer_windows({**config, "sliding_window": window or 1}, n_layers)
    pattern = next((p for p in range(1, n_layers + 2)
                    if windows == tuple(window or 1 if (i + 1) % p else None for i in range(n_layers))), None)
    if pattern is None:
        problems.append("layer types that no sliding_window_pattern describes")
    if problems:
        raise ValueError(f"cannot write this Gemma 3 to GGUF: {'; '.join(problems)}")
    writer.add_rope_freq_base(theta)
    writer.add_key_value(f"{writer.arch}.rope.freq_base_swa", float(local_theta), _gguf_type("FLOAT32"))
    if scaling is not None:
        if scaling.get("rope_type", scaling.get("type")) != "linear":
            raise ValueError(f"cannot write this Gemma 3 to GGUF: rope scaling {scaling!r} (linear only)")
        writer.add_rope_scaling_type(_rope_scaling_type("LINEAR"))
        writer.add_rope_scaling_factor(float(scaling["factor"]))
    if pattern != 6:
        logger.warning("Gemma 3 with every %d-th layer global: pagoda reads the pattern from the file, "
                       "llama.cpp assumes every 6th", pattern)
    writer.add_sliding_window(int(window))
    writer.add_key_value(f"{writer.arch}.attention.sliding_window_pattern", int(pattern), _gguf_type("UINT32"))
    if config.get("final_logit_softcapping") is not None:
        writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))


def _gguf_type(name: str):
    import gguf  # deferred: gguf loads on first use

    return gguf.GGUFValueType[name]


def _rope_scaling_type(name: str):
    import gguf  # deferred: gguf loads on first use

    return gguf.RopeScalingType[name]
