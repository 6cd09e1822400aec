"""The real SmolLM2-135M-Instruct under a LoRA adapter that peft makes here: pagoda's fp32 greedy
tokens equal transformers + peft's on the same (dequantized) weights and adapter, alone and in a
batch beside the base model."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.lora import LoRARequest
from tests.lora.adapters import ALL_TARGETS

MAX_TOKENS = 16
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    return LLM(model="smollm2", dtype="float32", kv_cache_memory=0.25, enable_lora=True, max_loras=2)


@pytest.fixture(scope="module")
def reference_and_adapter(smol, tmp_path_factory):
    """transformers' Llama on the GGUF's dequantized weights, and a peft adapter of it (random A
    and B, saved): the base's and the adapter's greedy tokens for each question."""
    import peft
    import transformers

    from pagoda.loader.gguf_weights import iter_gguf_weights

    files = smol.engine.config.model.files
    config = transformers.AutoConfig.from_pretrained(files.metadata_dir)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.load_state_dict(dict(iter_gguf_weights(files.gguf_file, files.hf_config())), strict=False)
    model.tie_weights()
    model.generation_config.eos_token_id = None  # to max_tokens, as pagoda's ignore_eos
    prompts = [smol.get_tokenizer().encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]

    def greedy(m) -> list[list[int]]:
        with torch.no_grad():
            return [m.generate(input_ids=torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                               pad_token_id=0)[0, len(ids):].tolist() for ids in prompts]

    base = greedy(model)
    torch.manual_seed(11)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=ALL_TARGETS,
                                                      init_lora_weights=False, lora_dropout=0.0))
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.02)
    out = tmp_path_factory.mktemp("smol-lora") / "adapter"
    lora.save_pretrained(out)
    return prompts, base, greedy(lora.eval()), out


def test_adapter_and_base_in_one_batch_equal_transformers_and_peft(smol, reference_and_adapter):
    prompts, base, adapted, adapter_dir = reference_and_adapter
    assert base != adapted  # the adapter changes the answers
    lora = LoRARequest("smol-lora", 1, str(adapter_dir))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = smol.generate([{"prompt_token_ids": ids} for ids in prompts * 2], params, use_tqdm=False,
                         lora_request=[lora] * len(prompts) + [None] * len(prompts))
    got = [o.outputs[0].token_ids for o in outs]
    assert got == adapted + base
