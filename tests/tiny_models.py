"""Tiny random-weight models built from transformers configs, for fast parity tests.

Each model is a real Hugging Face directory (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a ChatML template, generation_config.json), so pagoda loads it
through exactly the code path a downloaded model takes, and transformers can load the same
directory as the reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "def main():\n    print('hello world')\n    return 0\n",
    "In 1492, Columbus sailed the ocean blue; numbers like 3.14159 and 2718 appear too.",
    "pagoda serves language models: tokenize, forward, sample, detokenize.",
    "你好，世界。机器学习很有趣！ Emoji: 😀🚀🎉",
    "Once upon a time there was a little engine that could, and it batched every request.",
]

VOCAB_SIZE = 384


def make_tokenizer(out_dir: Path) -> None:
    """Train a small byte-level BPE tokenizer (deterministic) and save it with its config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "chat_template": CHATML_TEMPLATE,
        "model_max_length": 256,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


def _config(arch: str, vocab_size: int):
    import transformers

    if arch in SSM_ARCHS:
        return _ssm_config(arch, vocab_size)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        return transformers.LlamaConfig(rope_theta=10000.0, **common)
    if arch == "qwen2":
        return transformers.Qwen2Config(rope_theta=1000000.0, **common)
    if arch == "qwen3":
        return transformers.Qwen3Config(rope_theta=1000000.0, head_dim=32, **common)
    if arch == "mistral":  # every layer windowed: the prompts are longer than the window
        return transformers.MistralConfig(rope_theta=10000.0, sliding_window=TINY_WINDOW, **common)
    if arch == "gemma3":  # local, local, global, local (sliding_window_pattern 3, as the GGUF stores it)
        common.update(num_hidden_layers=4, tie_word_embeddings=True)
        return transformers.Gemma3TextConfig(
            head_dim=32, query_pre_attn_scalar=32, sliding_window=TINY_WINDOW,  # the scalar llama.cpp assumes
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
            **common)
    if arch in MOE_ARCHS or arch == "phi3":
        return _moe_or_phi3_config(arch, common)
    raise ValueError(f"unknown tiny architecture {arch!r}")


MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def _moe_or_phi3_config(arch: str, common: dict):
    """The mixture-of-experts families (8 experts, 2 per token; Mixtral 4) and Phi-3 (its
    checkpoint fuses qkv and gate/up; LongRoPE with a 64-token original context)."""
    import transformers

    experts = dict(num_experts=8, num_experts_per_tok=2)
    if arch == "mixtral":
        return transformers.MixtralConfig(rope_theta=1e6, num_local_experts=4, num_experts_per_tok=2,
                                          **{**common, "intermediate_size": 64})
    if arch == "qwen2_moe":  # a shared expert behind its sigmoid gate; top-k weights not renormalized
        return transformers.Qwen2MoeConfig(rope_theta=1e6, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                           norm_topk_prob=False, **experts, **common)
    if arch == "qwen3_moe":  # q/k norms; top-k weights renormalized
        return transformers.Qwen3MoeConfig(rope_theta=1e6, head_dim=32, moe_intermediate_size=32, norm_topk_prob=True,
                                           **experts, **common)
    if arch == "olmoe":  # q/k norms over the whole projection, clipped q/k/v
        return transformers.OlmoeConfig(rope_theta=1e4, clip_qkv=1.5, norm_topk_prob=False,
                                        **experts, **{**common, "intermediate_size": 32})
    head_dim = common["hidden_size"] // common["num_attention_heads"]
    long_rope = {"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": PHI3_ORIGINAL_CONTEXT,
                 "short_factor": [1.0 + 0.05 * i for i in range(head_dim // 2)],
                 "long_factor": [1.5 + 0.5 * i for i in range(head_dim // 2)]}
    return transformers.Phi3Config(rope_parameters=long_rope, original_max_position_embeddings=PHI3_ORIGINAL_CONTEXT,
                                   **common)


SSM_ARCHS = ("mamba2", "bamba", "granitemoehybrid")


def _ssm_config(arch: str, vocab_size: int):
    """The state-space families: Mamba-2 (three mixers), Bamba and Granite 4.0-H (mixer,
    attention, mixer, mixer; Granite's attention without rotary, as Granite 4.0-H's, its MLPs a
    shared one and 4 experts, 2 a token, and every multiplier away from 1); 8 heads of 16 in 2
    groups, a state of 16, and chunks of 8 tokens in transformers' scan, so the prompts here span
    several."""
    import transformers

    if arch == "mamba2":
        return transformers.Mamba2Config(vocab_size=vocab_size, hidden_size=64, num_heads=8, head_dim=16, n_groups=2,
                                         state_size=16, chunk_size=8, conv_kernel=4, num_hidden_layers=3,
                                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    common = dict(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, mamba_n_heads=8, mamba_d_head=16,
                  mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=8, mamba_d_conv=4)
    if arch == "bamba":
        return transformers.BambaConfig(intermediate_size=128, attn_layer_indices=[1], **common)
    return transformers.GraniteMoeHybridConfig(
        intermediate_size=32, shared_intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["mamba", "attention", "mamba", "mamba"], position_embedding_type="nope",
        embedding_multiplier=3.0, residual_multiplier=0.6, attention_multiplier=0.2, logits_scaling=2.5, **common)


PHI3_ORIGINAL_CONTEXT = 64  # the tiny Phi-3's original context: LongRoPE's long factors apply past it


TINY_WINDOW = 12  # the tiny Mistral's and Gemma 3's sliding window: 1.5 blocks of 8


def make_tiny_hf_model(arch: str, out_dir: Path, *, seed: int = 0, tie_word_embeddings: bool = False,
                       **config_overrides) -> Path:
    """Write a tiny random-weight model of the given family ('llama', 'qwen2', 'qwen3', 'mistral',
    'gemma3') to out_dir, with ``config_overrides`` set on its transformers config. Gemma 3 always
    ties its embeddings."""
    import transformers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    make_tokenizer(out_dir)
    config = _config(arch, VOCAB_SIZE)
    config.tie_word_embeddings = tie_word_embeddings or arch == "gemma3"
    for key, value in config_overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init leaves norms at 1 and biases at 0; perturb them so the test exercises them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias", "dt_bias", ".D", "A_log")):  # (the last three: Mamba-2's)
                p.add_(torch.randn_like(p) * 0.1)
            elif p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def boost_eos(model_dir: Path, eos: int = 2, factor: float = 4.0) -> Path:
    """Scale a tiny model's end-of-sequence row of lm_head so its logit swings wide and often lands
    among the top candidates (beam search tests: beams end at different lengths)."""
    from safetensors.torch import load_file, save_file

    weights = load_file(model_dir / "model.safetensors")
    weights["lm_head.weight"][eos] *= factor
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "bos_token_id": 1}))
    return model_dir


# -- an encoder: BERT with a WordPiece tokenizer ---------------------------------------------------
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def make_bert_tokenizer(out_dir: Path) -> int:
    """A BERT-style WordPiece tokenizer (lower case, [CLS] ... [SEP]) over the corpus's words and
    characters; returns its vocabulary size."""
    import re

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    words = sorted({w for text in _CORPUS for w in re.findall(r"\w+", text.lower())})
    chars = sorted({c for text in _CORPUS for c in text.lower() if not c.isspace()})
    vocab = {t: i for i, t in enumerate(dict.fromkeys(BERT_SPECIALS + chars + ["##" + c for c in chars] + words))}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tok.decoder = decoders.WordPiece()
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "BertTokenizerFast", "do_lower_case": True, "cls_token": "[CLS]", "sep_token": "[SEP]",
        "pad_token": "[PAD]", "unk_token": "[UNK]", "mask_token": "[MASK]", "model_max_length": 128}))
    return len(vocab)


def make_tiny_bert(out_dir: Path, *, seed: int = 0, sentence_transformers: str | None = None,
                   matryoshka: bool = False) -> Path:
    """A random BertModel directory (2 layers, hidden 32). ``sentence_transformers``: a pooling
    mode ("mean", "cls") makes it a sentence-transformers directory (modules.json, the Pooling
    module's config, Normalize); ``matryoshka``: its config.json says it may be cut to 8 or 16."""
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_size = make_bert_tokenizer(out_dir)
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    with torch.no_grad():  # larger than the init's 0.02: a test that layers differ must see it
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(out_dir, safe_serialization=True)
    if matryoshka:
        data = json.loads((out_dir / "config.json").read_text())
        data["matryoshka_dimensions"] = [8, 16, 32]
        (out_dir / "config.json").write_text(json.dumps(data))
    if sentence_transformers is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                   {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
        (out_dir / "modules.json").write_text(json.dumps(modules))
        (out_dir / "1_Pooling").mkdir(exist_ok=True)
        (out_dir / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": 32, "pooling_mode_cls_token": sentence_transformers == "cls",
            "pooling_mode_mean_tokens": sentence_transformers == "mean"}))
        (out_dir / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 48}))
    return out_dir


def make_tiny_cross_encoder(out_dir: Path, *, seed: int = 0) -> Path:
    """A random BertForSequenceClassification of one label (a reranker: a pair in, a relevance
    logit out), with the WordPiece tokenizer above."""
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_size = make_bert_tokenizer(out_dir)
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_labels=1,
                                     num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
    model = transformers.BertForSequenceClassification(config).eval()
    with torch.no_grad():  # larger than the init's 0.02, so that the token types' rows differ enough to see
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
