"""PEFT adapters made for the tiny models (and SmolLM2) by peft itself, and transformers + peft's
greedy tokens under them: the reference pagoda's LoRA must equal."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(model_dir: Path, out_dir: Path, *, rank: int = 8, alpha: float = 16, seed: int = 0,
                      targets: list[str] | None = None, use_rslora: bool = False, magnitude: float = 0.3,
                      parameters: list[str] | None = None) -> Path:
    """A LoRA adapter of ``model_dir`` with random A and B (peft's own init leaves B at zero, an
    adapter that changes nothing), saved by peft. ``parameters``: peft's ``target_parameters`` (a
    mixture's fused expert weights)."""
    import peft
    import transformers

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ALL_TARGETS, use_rslora=use_rslora,
                             lora_dropout=0.0, init_lora_weights=False, target_parameters=parameters)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, magnitude / rank ** 0.5)
    model.save_pretrained(out_dir)
    return out_dir


def peft_greedy(model_dir: Path, adapter_dir: Path | None, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers (+ peft when ``adapter_dir``) greedy continuations of each prompt."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    model.generation_config.eos_token_id = None  # plain argmax to the end: pagoda's ignore_eos runs on past an eos
    outs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
            outs.append(out[0, len(ids):].tolist())
    return outs
