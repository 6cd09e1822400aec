"""Write a Hugging Face model directory as a GGUF file, as llama.cpp's ``convert_hf_to_gguf.py`` does.

`pagoda create NAME -f Modelfile` with `FROM` a Hugging Face directory stores the model this way
(Ollama imports safetensors the same way), so the store holds one GGUF per model and llama.cpp
and Ollama can load what pagoda made. What is written:

- metadata under llama.cpp's keys (context, sizes, heads, norm epsilon, rope base and scaling);
- the tokenizer: byte-level BPE (`tokenizer.json`: vocabulary, merges, token types, bos / eos /
  pad, the chat template), with the `tokenizer.ggml.pre` name that selects the same
  pre-tokenization in llama.cpp. The pre-tokenizer is recognised from `tokenizer.json` itself;
  one this module does not recognise is refused rather than written as something that would
  split text differently. SentencePiece / Unigram tokenizers are refused too;
- tensors under llama.cpp's names, the `llama` architecture's Q/K rows permuted to its
  interleaved rotary order, 2-D weights in ``qtype`` (F32, F16, BF16, or the blocks
  `gguf.quants` can write: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), norms and biases in F32.

Architectures: llama (and mistral, which llama.cpp writes as llama, without its sliding window),
qwen2, qwen3, gemma3 (text: its norms stored as ``1 + w`` and its sliding-window keys, as llama.cpp's
converter writes them), phi3 (fused ``attn_qkv`` and gate/up as ``ffn_up``; LongRoPE factors as the
``rope_factors_short`` / ``rope_factors_long`` tensors), and the mixture-of-experts families:
mixtral (as llama with experts), qwen2moe, qwen3moe, olmoe. A layer's experts are stacked into one
tensor per projection (``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``, [experts, rows,
columns]), the router is ``ffn_gate_inp`` and Qwen2-MoE's shared expert ``ffn_*_shexp`` with its
gate ``ffn_gate_inp_shexp``; routers stay F32, as llama.cpp keeps them. The table is
models/architectures.py's, which the reader shares.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagoda.models.architectures import GGUF_WRITE_ARCHITECTURES
from pagoda.models.config import layer_windows, rope_scaling

# Types gguf.quants can *write*. The K-quants it can only read.
WRITABLE_QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
_ARCHITECTURES = GGUF_WRITE_ARCHITECTURES  # HF model_type → general.architecture

logger = logging.getLogger(__name__)

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
# Gemma 3 norms around both sublayers: llama.cpp's ffn_norm is the pre-FFN one there.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_MOE_LAYER_NAMES = {
    **_LAYER_NAMES,
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "block_sparse_moe.gate": "ffn_gate_inp",  # Mixtral's
}
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
# an expert's projection (Qwen / OLMoE names, Mixtral's) → the stacked tensor it joins
_EXPERT_TENSORS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                   "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
_EXPERT_NAME = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_F32_LAYER_TENSORS = ("ffn_gate_inp", "ffn_gate_inp_shexp")  # routers: llama.cpp keeps them F32
_MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}

# Pre-tokenizer regexes of tokenizer.json → llama.cpp's name for the same splitting.
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class BlockTensor:
    """A 2-D weight already in ggml blocks (``pagoda quantize``): ``blocks`` uint8 [rows, bytes per
    row] of ``qtype`` (Q4_0, Q4_1 or Q8_0), rows in the Hugging Face order, written as they are."""

    blocks: np.ndarray
    qtype: str


def gguf_tensor_name(hf_name: str, arch: str = "llama") -> str:
    """llama.cpp's name for an HF parameter (``model.layers.3.mlp.up_proj.weight`` → ``blk.3.ffn_up.weight``)."""
    stem, _, suffix = hf_name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    names = {"gemma3": _GEMMA3_LAYER_NAMES, "phi3": _PHI3_LAYER_NAMES}.get(arch, _MOE_LAYER_NAMES)
    parts = stem.split(".", 3)
    if len(parts) != 4 or parts[:2] != ["model", "layers"] or parts[3] not in names:
        raise ValueError(f"cannot write {hf_name!r} to GGUF: not a tensor of the {arch} layout")
    return f"blk.{parts[2]}.{names[parts[3]]}.{suffix}"


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (HF rotate-half row order → interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _permute_rows(w: np.ndarray | BlockTensor, n_head: int) -> np.ndarray | BlockTensor:
    """``permute_qk`` of a float weight or of a quantized one's rows (blocks run along a row)."""
    if isinstance(w, BlockTensor):
        return BlockTensor(permute_qk(w.blocks, n_head), w.qtype)
    return permute_qk(w, n_head)


def quantize_weight(w: np.ndarray, qtype: str) -> np.ndarray:
    """``w`` in the storage form GGUFWriter takes for ``qtype`` (ValueError where gguf cannot)."""
    import gguf  # deferred: gguf loads on first use

    if qtype not in WRITABLE_QTYPES:
        raise ValueError(f"cannot write {qtype}: gguf can write {', '.join(WRITABLE_QTYPES)}")
    block_size, _ = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    if w.shape[-1] % block_size:
        raise ValueError(f"cannot write {qtype}: row length {w.shape[-1]} is not a multiple of {block_size}")
    return gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), gguf.GGMLQuantizationType[qtype])


def pre_tokenizer_name(pre_tokenizer: dict | None) -> str:
    """llama.cpp's `tokenizer.ggml.pre` for a tokenizer.json pre-tokenizer (ValueError if unknown)."""
    kinds = [p.get("type") for p in (pre_tokenizer or {}).get("pretokenizers", [pre_tokenizer or {}])]
    if kinds == ["ByteLevel"] and (pre_tokenizer or {}).get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and pre_tokenizer["pretokenizers"][0].get("individual_digits"):
        return "smollm"  # digits apart, then GPT-2's regex (also starcoder's, refact's)
    if kinds and kinds[0] == "Split":
        regex = ((pre_tokenizer.get("pretokenizers") or [pre_tokenizer])[0].get("pattern") or {}).get("Regex")
        if regex == _LLAMA3_REGEX:
            return "llama-bpe"
        if regex == _QWEN2_REGEX:
            return "qwen2"
    raise ValueError(f"cannot write this tokenizer to GGUF: its pre-tokenizer ({json.dumps(pre_tokenizer)[:200]}) "
                     "is not one llama.cpp names that pagoda recognises (gpt-2, smollm, llama-bpe, qwen2)")


def _rope_theta(config: dict) -> float:
    params = config.get("rope_parameters") or {}
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def _add_model_metadata(writer, config: dict, arch: str, name: str) -> None:
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


def _phi3_rope_factors(config: dict) -> Iterator[tuple[str, np.ndarray]]:
    scaling = rope_scaling(config)
    for kind in ("short", "long") if scaling is not None else ():
        yield f"rope_factors_{kind}.weight", np.asarray(scaling[f"{kind}_factor"], dtype=np.float32)


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


def _add_tokenizer(writer, hf_dir: Path, config: dict) -> None:
    import gguf  # deferred: gguf loads on first use

    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{hf_dir} has no tokenizer.json: only byte-level BPE tokenizers can be written to GGUF")
    tok = json.loads(path.read_text())
    if (tok.get("model") or {}).get("type") != "BPE":
        raise ValueError(f"cannot write this tokenizer to GGUF: {tok.get('model', {}).get('type')} tokenizers are "
                         "not supported (byte-level BPE only)")
    pre = pre_tokenizer_name(tok.get("pre_tokenizer"))
    tok_config_path = hf_dir / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text()) if tok_config_path.is_file() else {}
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok.get("added_tokens", []) if t.get("special", True)}
    vocab.update({t["content"]: t["id"] for t in tok.get("added_tokens", [])})
    size = max(config["vocab_size"], max(vocab.values()) + 1)
    tokens: list[str | None] = [None] * size
    for text, index in vocab.items():
        tokens[index] = text
    tokens = [text if text is not None else f"[PAD{i}]" for i, text in enumerate(tokens)]  # as llama.cpp pads
    token_types = [gguf.TokenType.CONTROL if text in special else
                   gguf.TokenType.UNUSED if text.startswith("[PAD") else gguf.TokenType.NORMAL for text in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("pad_token_id", writer.add_pad_token_id)):
        value = config.get(key)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            add(int(value))
    writer.add_add_bos_token(bool(tok_config.get("add_bos_token", False)))
    template = tok_config.get("chat_template")
    if isinstance(template, str) and template:
        writer.add_chat_template(template)
    elif (hf_dir / "chat_template.jinja").is_file():
        writer.add_chat_template((hf_dir / "chat_template.jinja").read_text())


def _hf_tensors(hf_dir: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor of the directory's safetensors files (sharded or not), as float32."""
    import torch  # torch loads on first use
    from safetensors import safe_open  # deferred: safetensors loads on first use

    from pagoda.loader.safetensors import safetensors_files  # deferred: loads torch

    for path in safetensors_files(hf_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name).to(torch.float32).numpy()


def _add_tensors(writer, hf_dir: Path, config: dict, arch: str, qtype: str,
                 tensors: Iterable[tuple[str, np.ndarray | BlockTensor]] | None = None) -> None:
    n_head = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_head
    experts = _ExpertStacks(config)
    for hf_name, w in (_hf_tensors(hf_dir) if tensors is None else tensors):
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue  # computed, not learned
        if config.get("tie_word_embeddings") and hf_name == "lm_head.weight":
            continue  # llama.cpp omits output.weight when the head is the embedding
        if experts.holds(hf_name):  # kept until its layer's every expert is read, then stacked
            stacked = experts.add(hf_name, w)
            if stacked is not None:
                _add_weight(writer, *stacked, qtype)
            continue
        if arch == "llama" and ".self_attn.q_proj." in hf_name:
            w = _permute_rows(w, n_head)
        elif arch == "llama" and ".self_attn.k_proj." in hf_name:
            w = _permute_rows(w, n_kv)
        elif arch == "gemma3" and hf_name.endswith("norm.weight"):
            w = w + np.float32(1.0)  # llama.cpp stores Gemma's RMSNorm weight as (1 + w)
        name = gguf_tensor_name(hf_name, arch)
        if name.rsplit(".", 2)[-2] in _F32_LAYER_TENSORS and not isinstance(w, BlockTensor):
            # routers stay F32; the shared expert's gate [1, hidden] is stored as [hidden]
            writer.add_tensor(name, np.ascontiguousarray(w.reshape(-1) if "_shexp" in name else w, dtype=np.float32))
            continue
        _add_weight(writer, name, w, qtype)
    experts.check_complete()
    if arch == "phi3":
        for name, factors in _phi3_rope_factors(config):
            writer.add_tensor(name, factors)


def _add_weight(writer, name: str, w: np.ndarray | BlockTensor, qtype: str) -> None:
    """A weight in ``qtype`` (2-D ones and stacked experts' 3-D ones; norms and biases stay F32)."""
    import gguf  # deferred: gguf loads on first use

    if isinstance(w, BlockTensor):
        writer.add_tensor(name, np.ascontiguousarray(w.blocks), raw_dtype=gguf.GGMLQuantizationType[w.qtype])
    elif w.ndim < 2 or qtype == "F32":
        writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    elif qtype == "F16":
        writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float16))
    else:
        stored = quantize_weight(w, qtype)
        raw = gguf.GGMLQuantizationType[qtype]
        writer.add_tensor(name, stored, raw_dtype=raw if stored.dtype == np.uint8 else None)


class _ExpertStacks:
    """Each layer's per-expert tensors, collected into llama.cpp's stacked [experts, rows, columns]
    tensors (a ``BlockTensor``'s blocks stack the same way)."""

    def __init__(self, config: dict) -> None:
        self.count = int(config.get("num_experts") or config.get("num_local_experts") or 0)
        self.pending: dict[str, dict[int, np.ndarray | BlockTensor]] = {}  # GGUF name → expert → weight

    def holds(self, hf_name: str) -> bool:
        return self.count > 0 and _EXPERT_NAME.fullmatch(hf_name) is not None

    def add(self, hf_name: str, w: np.ndarray | BlockTensor) -> tuple[str, np.ndarray | BlockTensor] | None:
        """(GGUF name, stacked weight) once ``hf_name``'s layer has every expert of it, else None."""
        layer, expert, projection = _EXPERT_NAME.fullmatch(hf_name).groups()
        name = f"blk.{layer}.{_EXPERT_TENSORS[projection]}.weight"
        stack = self.pending.setdefault(name, {})
        stack[int(expert)] = w
        if len(stack) < self.count:
            return None
        done = self.pending.pop(name)
        parts = [done[i] for i in range(self.count)]
        if all(isinstance(p, BlockTensor) for p in parts) and len({p.qtype for p in parts}) == 1:
            return name, BlockTensor(np.stack([p.blocks for p in parts]), parts[0].qtype)
        return name, np.stack([p if isinstance(p, np.ndarray) else _dequantized(p) for p in parts])

    def check_complete(self) -> None:
        for name, stack in self.pending.items():
            raise ValueError(f"cannot write this model to GGUF: {name} has {len(stack)} of {self.count} experts")


def _dequantized(w: BlockTensor) -> np.ndarray:
    import gguf  # deferred: gguf loads on first use

    return gguf.quants.dequantize(w.blocks, gguf.GGMLQuantizationType[w.qtype])


def write_gguf(hf_dir: Path | str, out_path: Path | str, qtype: str = "F16", *, name: str | None = None,
               architecture: str | None = None, customize: Callable | None = None,
               tensors: Iterable[tuple[str, np.ndarray | BlockTensor]] | None = None) -> Path:
    """Write the model in ``hf_dir`` to ``out_path`` with its 2-D weights in ``qtype``.

    ``tensors`` (Hugging Face name → float32 array, or a ``BlockTensor`` written as it is) replaces
    the directory's safetensors as the source of the weights; ``hf_dir`` then gives only the config
    and tokenizer (``pagoda quantize``, whose model may have come from a GGUF).
    ``architecture`` overrides the ``general.architecture`` written (tests of unsupported ones);
    ``customize(writer)`` may add metadata before the file is written. ValueError names what
    cannot be written (an architecture, a tokenizer, a qtype, a row length)."""
    import gguf  # deferred: gguf loads on first use

    hf_dir, out_path = Path(hf_dir), Path(out_path)
    qtype = qtype.upper()
    if qtype not in WRITABLE_QTYPES:
        raise ValueError(f"cannot write {qtype}: gguf can write {', '.join(WRITABLE_QTYPES)}")
    config = json.loads((hf_dir / "config.json").read_text())
    arch = _ARCHITECTURES.get(config.get("model_type", ""))
    if arch is None:
        raise ValueError(f"cannot write a {config.get('model_type')!r} model to GGUF: pagoda writes "
                         f"{', '.join(sorted(_ARCHITECTURES))}")
    writer = gguf.GGUFWriter(str(out_path), architecture or arch)
    try:
        _add_model_metadata(writer, config, arch, name or hf_dir.name)
        file_type = {"F32": "ALL_F32", "F16": "MOSTLY_F16"}.get(qtype, f"MOSTLY_{qtype}")
        writer.add_file_type(gguf.LlamaFileType[file_type])
        _add_tokenizer(writer, hf_dir, config)
        _add_tensors(writer, hf_dir, config, arch, qtype, tensors)
        if customize is not None:
            customize(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return out_path
