"""Tiny random-weight vision-language models built from transformers configs, for parity tests.

Each is a real Hugging Face directory: config.json, model.safetensors, a tokenizer with the
family's image tokens, a Gemma-style chat template that renders image parts, and the processor's
files (preprocessor_config.json, processor_config.json) that transformers' ``AutoProcessor``
loads, so the reference is transformers' own processor and model on the same directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tiny_models import SPECIAL_TOKENS, TINY_WINDOW, _CORPUS

GEMMA3_IMAGE_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                       "image_token": "<image_soft_token>"}
TURN_TOKENS = ["<start_of_turn>", "<end_of_turn>"]
VISION_VOCAB = 400

# Gemma 3's template, cut to what the tests use: a user turn's content parts (an image is its
# <start_of_image>, text is trimmed) and the generation prompt.
GEMMA3_TEMPLATE = (
    "{% for message in messages %}{{ '<start_of_turn>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def _tokenizer(out_dir: Path, image_tokens: dict[str, str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = SPECIAL_TOKENS + TURN_TOKENS + list(image_tokens.values())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VISION_VOCAB - 8, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<end_of_turn>",
              "pad_token": "<|endoftext|>", "unk_token": None, "add_bos_token": False,
              "chat_template": GEMMA3_TEMPLATE, "model_max_length": 512, "extra_special_tokens": image_tokens}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _perturb(model: torch.nn.Module) -> None:
    """Random init leaves norms at 1 (or 0 for Gemma's 1 + w) and biases at 0: perturb them."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.08)


def make_tiny_gemma3_vision(out_dir: Path, *, seed: int = 0, image_size: int = 56, window: int = TINY_WINDOW) -> Path:
    """A tiny ``Gemma3ForConditionalGeneration``: the tiny Gemma 3 text model (4 layers, local,
    local, global, local) under a 2-layer SigLIP tower on ``image_size`` pixels in 14-pixel
    patches, pooled to 4 image tokens (2 x 2); its processor resizes any image to that size."""
    import transformers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _tokenizer(out_dir, GEMMA3_IMAGE_TOKENS)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir)
    text = transformers.Gemma3TextConfig(
        vocab_size=VISION_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=window,
        max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, image_size=image_size, patch_size=14,
                                             vision_use_head=False)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       boi_token_index=tokenizer.convert_tokens_to_ids("<start_of_image>"),
                                       eoi_token_index=tokenizer.convert_tokens_to_ids("<end_of_image>"),
                                       image_token_index=tokenizer.convert_tokens_to_ids("<image_soft_token>"))
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    _perturb(model)
    model.save_pretrained(out_dir, safe_serialization=True)
    image_processor = transformers.Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size},
                                                           image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = transformers.Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                             chat_template=GEMMA3_TEMPLATE, image_seq_length=4)
    processor.save_pretrained(out_dir)
    return out_dir


def random_image(seed: int, size: tuple[int, int] = (40, 30), mode: str = "RGB"):
    """A PIL image of random pixels (not square, so resizing is exercised)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    array = rng.integers(0, 256, size=(size[1], size[0], channels), dtype=np.uint8)
    return Image.fromarray(array.squeeze(-1) if channels == 1 else array, mode=mode)


def chat_text(processor, parts: list[dict]) -> str:
    """One user turn of ``parts`` ({"type": "image"} / {"type": "text", ...}) through the
    processor's chat template, with the generation prompt."""
    return processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                         tokenize=False)


def hf_greedy(ref, processor, text: str, images: list, max_tokens: int, bidirectional: bool = True):
    """transformers' (prompt ids, greedy tokens, their logprobs) for ``text`` with ``images``; with
    ``bidirectional`` False, without ``token_type_ids`` (every token causal)."""
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    types = inputs.pop("token_type_ids", None)  # (Gemma 3's processor marks image tokens; LLaVA's does not)
    bidirectional = bidirectional and types is not None
    if bidirectional and images:
        inputs["token_type_ids"] = types
    with torch.no_grad():
        full = ref.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                            pad_token_id=0)[0]
        n = inputs["input_ids"].shape[1]
        extra = {"pixel_values": inputs["pixel_values"]} if images else {}
        if bidirectional and images:
            extra["token_type_ids"] = torch.cat([types, torch.zeros(1, len(full) - n, dtype=types.dtype)], dim=1)
        logits = ref(input_ids=full.unsqueeze(0), **extra).logits[0].float()
    new = full[n:]
    logprobs = torch.log_softmax(logits, dim=-1)[n - 1 : -1].gather(1, new.unsqueeze(1)).squeeze(1)
    return inputs["input_ids"][0].tolist(), new.tolist(), logprobs.tolist()


LLAVA_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<image>\n' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def make_tiny_llava(out_dir: Path, *, seed: int = 0, image_size: int = 28, strategy: str = "default") -> Path:
    """A tiny ``LlavaForConditionalGeneration``: the tiny Llama (2 layers) under a 3-layer CLIP
    tower on ``image_size`` pixels in 7-pixel patches (16 patches and a CLS token), features
    from its second-to-last layer, the CLS token dropped (``strategy`` "default") or kept ("full");
    its CLIP processor resizes the shortest edge and crops the centre."""
    import transformers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _tokenizer(out_dir, {"image_token": "<image>"})
    tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir)
    text = transformers.LlamaConfig(vocab_size=VISION_VOCAB, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
                                    bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                    pad_token_id=tokenizer.pad_token_id)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                           num_attention_heads=2, image_size=image_size, patch_size=7,
                                           projection_dim=32)
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    patches = (image_size // 7) ** 2
    config = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_index=image_token,
                                      vision_feature_select_strategy=strategy, vision_feature_layer=-2,
                                      image_seq_length=patches + (strategy == "full"))
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    _perturb(model)
    model.save_pretrained(out_dir, safe_serialization=True)
    image_processor = transformers.CLIPImageProcessorPil(size={"shortest_edge": image_size},
                                                         crop_size={"height": image_size, "width": image_size})
    processor = transformers.LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                            chat_template=LLAVA_TEMPLATE, patch_size=7,
                                            vision_feature_select_strategy=strategy, num_additional_image_tokens=1)
    processor.save_pretrained(out_dir)
    return out_dir


def greedy_params(max_tokens: int):
    """Greedy fp32 tokens to compare, each with its logprob."""
    from pagoda import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)


def image_prompt(text: str, images: list) -> dict:
    """vLLM's prompt shape with images, as ``LLM.generate`` takes it."""
    return {"prompt": text, "multi_modal_data": {"image": images}}


def assert_matches_hf(out, want, atol: float = 1e-4) -> None:
    """pagoda's output equals ``hf_greedy``'s: the processor's prompt ids (placeholders where it
    puts them), the greedy tokens, their logprobs within ``atol``."""
    prompt_ids, tokens, logprobs = want
    assert out.prompt_token_ids == prompt_ids
    got = out.outputs[0]
    assert got.token_ids == tokens
    ours = [pos[t].logprob for t, pos in zip(got.token_ids, got.logprobs)]
    assert max(abs(a - b) for a, b in zip(ours, logprobs)) < atol


def reference(model_dir: Path, model_class: str = "Gemma3ForConditionalGeneration"):
    """(transformers' model in fp32, its processor) of a directory, the tests' reference."""
    import transformers

    model = getattr(transformers, model_class).from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, transformers.AutoProcessor.from_pretrained(model_dir)
