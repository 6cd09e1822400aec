"""The model shape pagoda needs, read from a Hugging Face config.json (any transformers version)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransformerConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    sliding_windows: tuple[int | None, ...] = ()  # per layer: its sliding window, None for global attention

    def window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None

    @classmethod
    def from_hf(cls, hf: dict, architecture: str, *, attention_bias: bool | None = None, qk_norm: bool = False) -> "TransformerConfig":
        num_heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        rope = hf.get("rope_parameters") or {}
        rope_theta = hf.get("rope_theta") or rope.get("rope_theta", 10000.0)
        return cls(
            architecture=architecture,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hidden // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling(hf),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=hf.get("attention_bias", False) if attention_bias is None else attention_bias,
            qk_norm=qk_norm,
            hidden_act=hf.get("hidden_act", "silu"),
            sliding_windows=layer_windows(hf, hf["num_hidden_layers"]),
        )


# rope types whose tables depend on the context the model was pretrained with
_WITH_ORIGINAL_CONTEXT = ("llama3", "yarn", "longrope")


def rope_scaling(hf: dict) -> dict | None:
    """config.json's rope scaling (``rope_scaling``, or transformers 5's ``rope_parameters``) as
    layers/rotary.py reads it, or None: ``rope_type`` set (Phi-3's old "su" / "yarn" are its
    LongRoPE, as transformers reads them), and for llama3 / yarn / longrope the original context
    (Phi-3's top-level ``original_max_position_embeddings`` first, as in transformers) and the
    model's ``max_position_embeddings`` (yarn's and longrope's default factor is their ratio).
    A partial rotary (``partial_rotary_factor`` < 1, e.g. Phi-4-mini) is refused."""
    params = hf.get("rope_parameters") or {}
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported (pagoda rotates whole heads)")
    scaling = dict(hf.get("rope_scaling") or params)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in ("default", None):
        return None
    if hf.get("model_type") == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"
    scaling["rope_type"] = rope_type
    if rope_type in _WITH_ORIGINAL_CONTEXT:
        max_position = hf.get("max_position_embeddings", 4096)
        original = hf.get("original_max_position_embeddings") if hf.get("model_type") == "phi3" else None
        scaling["original_max_position_embeddings"] = int(
            original or scaling.get("original_max_position_embeddings") or max_position)
        scaling["max_position_embeddings"] = max_position
        if rope_type == "yarn" and scaling.get("factor") is None:
            scaling["factor"] = max_position / scaling["original_max_position_embeddings"]
    return scaling


def layer_windows(hf: dict, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window from a config.json, as transformers reads it: none without a
    ``sliding_window`` (or with ``use_sliding_window: false``, Qwen's switch); else the layers that
    ``layer_types`` marks ``sliding_attention``, or Gemma's ``sliding_window_pattern`` (every n-th
    layer global), or Qwen's layers from ``max_window_layers`` on, or every layer (Mistral)."""
    window = hf.get("sliding_window")
    enabled = hf.get("use_sliding_window")
    if enabled is None:  # Qwen's switch defaults to off; other families have none
        enabled = hf.get("model_type") not in ("qwen2", "qwen3")
    if not window or not enabled:
        return (None,) * num_layers
    window = int(window)
    types = hf.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(f"layer types {sorted(unknown)} are not supported (sliding_attention, full_attention)")
        return tuple(window if t == "sliding_attention" else None for t in types)
    pattern = hf.get("sliding_window_pattern")
    if pattern:
        return tuple(window if (i + 1) % int(pattern) else None for i in range(num_layers))
    if hf.get("model_type") in ("qwen2", "qwen3") and hf.get("max_window_layers") is not None:
        return tuple(window if i >= int(hf["max_window_layers"]) else None for i in range(num_layers))
    return (window,) * num_layers
