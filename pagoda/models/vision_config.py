"""A vision-language model's config.json (``text_config`` + ``vision_config``) as pagoda reads it:
the language model's keys lifted to the top level, so everything that sizes a model from
config.json (the KV cache, the context, tensor parallelism, the sliding windows) reads them as
it reads a text model's, and the vision tower's config beside them.

transformers writes a sub-config's keys only where they differ from its class's defaults (the
hub's Gemma 3 4B names five keys of its text config), so the defaults are filled in here, from
transformers' ``Gemma3TextConfig``, ``SiglipVisionConfig``, ``LlamaConfig`` and
``CLIPVisionConfig``.
"""

from __future__ import annotations

_TEXT_DEFAULTS: dict[str, dict] = {
    "gemma3_text": dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072, rms_norm_eps=1e-6,
                        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, attention_bias=False,
                        query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=6,
                        final_logit_softcapping=None, attn_logit_softcapping=None, tie_word_embeddings=True),
    "llama": dict(vocab_size=32_000, hidden_size=4096, intermediate_size=11_008, num_hidden_layers=32,
                  num_attention_heads=32, hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6,
                  rope_theta=10_000.0, attention_bias=False, tie_word_embeddings=False),
}
_VISION_DEFAULTS: dict[str, dict] = {
    "siglip_vision_model": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                                num_channels=3, image_size=224, patch_size=16, hidden_act="gelu_pytorch_tanh",
                                layer_norm_eps=1e-6, vision_use_head=True),
    "clip_vision_model": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                              num_channels=3, image_size=224, patch_size=32, hidden_act="quick_gelu",
                              layer_norm_eps=1e-5),
}
# a vision-language model_type → its text and vision model types when config.json leaves them out
_SUB_TYPES = {"gemma3": ("gemma3_text", "siglip_vision_model"), "llava": ("llama", "clip_vision_model")}
# the keys a top-level config names under another name (transformers' attribute_map)
_ALIASES = {"image_token_index": "image_token_id", "boi_token_index": "boi_token_id", "eoi_token_index": "eoi_token_id"}


def is_vision_language(hf: dict) -> bool:
    return isinstance(hf.get("text_config"), dict) and isinstance(hf.get("vision_config"), dict)


def language_view(hf: dict) -> dict:
    """``hf`` itself for a text model; for a vision-language one, its text config (defaults filled
    in) at the top level, with the top level's architectures, model_type and multimodal keys, and
    ``vision_config`` completed the same way."""
    if not is_vision_language(hf):
        return hf
    text_type, vision_type = _SUB_TYPES.get(hf.get("model_type"), (None, None))
    text = {**_TEXT_DEFAULTS.get(hf["text_config"].get("model_type", text_type), {}), **hf["text_config"]}
    vision = {**_VISION_DEFAULTS.get(hf["vision_config"].get("model_type", vision_type), {}), **hf["vision_config"]}
    top = {k: v for k, v in hf.items() if k not in ("text_config", "vision_config")}
    for old, new in _ALIASES.items():
        if old in top:
            top.setdefault(new, top[old])
    view = {**text, **top, "text_model_type": text.get("model_type", text_type), "vision_config": vision}
    if "tie_word_embeddings" not in hf:  # the top level's default: the text config's
        view["tie_word_embeddings"] = text.get("tie_word_embeddings", False)
    return view
