"""The one table of model architectures pagoda runs, shared by the model classes
(models/model_classes.py: config.json ``architectures`` → model class), the GGUF reader
(loader/gguf_config.py: ``general.architecture`` → the config.json it writes) and the GGUF writer
(loader/gguf_writer.py: ``model_type`` → ``general.architecture``).

Plain data, no torch: the loaders import it without building any model code.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    hf_class: str  # config.json "architectures" entry
    module: str  # pagoda.models.<module> holds the model class
    model_class: str  # the class's name there
    model_types: tuple[str, ...]  # config.json "model_type" values of this architecture
    gguf: str | None = None  # llama.cpp's general.architecture, when pagoda reads / writes GGUFs of it
    gguf_model_type: str | None = None  # the model_type a GGUF of this architecture converts to
    gguf_experts: bool = False  # a GGUF of ``gguf`` is this architecture when it has experts (Mixtral's "llama")
    recurrent: bool = False  # state-space layers: a state slot per running request beside the KV cache


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("LlamaForCausalLM", "llama", "LlamaForCausalLM", ("llama",), gguf="llama", gguf_model_type="llama"),
    # llama.cpp writes Mistral as "llama" (no sliding window in the file); from a Hugging Face
    # directory, config.json's sliding_window applies to every layer.
    Architecture("MistralForCausalLM", "llama", "LlamaForCausalLM", ("mistral",)),
    Architecture("Qwen2ForCausalLM", "llama", "Qwen2ForCausalLM", ("qwen2",), gguf="qwen2", gguf_model_type="qwen2"),
    Architecture("Qwen3ForCausalLM", "llama", "Qwen3ForCausalLM", ("qwen3",), gguf="qwen3", gguf_model_type="qwen3"),
    Architecture("Gemma3ForCausalLM", "gemma3", "Gemma3ForCausalLM", ("gemma3_text",), gguf="gemma3",
                 gguf_model_type="gemma3_text"),
    # vision-language models (models/gemma3_vision.py, models/llava.py): images in prompts (pagoda/multimodal)
    Architecture("Gemma3ForConditionalGeneration", "gemma3_vision", "Gemma3ForConditionalGeneration", ("gemma3",)),
    Architecture("LlavaForConditionalGeneration", "llava", "LlavaForConditionalGeneration", ("llava",)),
    Architecture("Phi3ForCausalLM", "phi3", "Phi3ForCausalLM", ("phi3",), gguf="phi3", gguf_model_type="phi3"),
    # mixture of experts (models/moe.py); llama.cpp writes Mixtral as "llama" with expert tensors
    Architecture("MixtralForCausalLM", "mixtral", "MixtralForCausalLM", ("mixtral",), gguf="llama",
                 gguf_model_type="mixtral", gguf_experts=True),
    Architecture("Qwen2MoeForCausalLM", "qwen_moe", "Qwen2MoeForCausalLM", ("qwen2_moe",), gguf="qwen2moe",
                 gguf_model_type="qwen2_moe"),
    Architecture("Qwen3MoeForCausalLM", "qwen_moe", "Qwen3MoeForCausalLM", ("qwen3_moe",), gguf="qwen3moe",
                 gguf_model_type="qwen3_moe"),
    Architecture("OlmoeForCausalLM", "olmoe", "OlmoeForCausalLM", ("olmoe",), gguf="olmoe", gguf_model_type="olmoe"),
    # state-space models (Mamba-2 mixers: layers/mamba_mixer.py), pure and hybrid with attention
    Architecture("Mamba2ForCausalLM", "mamba2", "Mamba2ForCausalLM", ("mamba2",), recurrent=True),
    Architecture("BambaForCausalLM", "bamba", "BambaForCausalLM", ("bamba",), recurrent=True),
    Architecture("GraniteMoeHybridForCausalLM", "granite_hybrid", "GraniteMoeHybridForCausalLM",
                 ("granitemoehybrid",), recurrent=True),
    # an encoder (models/bert.py): served by the pooling runner only (embeddings, scores)
    Architecture("BertModel", "bert", "BertModel", ("bert",)),
    Architecture("BertForMaskedLM", "bert", "BertModel", ("bert",)),
    Architecture("BertForSequenceClassification", "bert_classifier", "BertForSequenceClassification", ("bert",)),
)

BY_HF_CLASS: dict[str, Architecture] = {a.hf_class: a for a in ARCHITECTURES}


def is_recurrent(hf_class: str) -> bool:
    """Whether the architecture keeps a recurrent state per request (state-space layers)."""
    arch = BY_HF_CLASS.get(hf_class)
    return arch is not None and arch.recurrent

# GGUF general.architecture → (HF class, HF model_type) of the config.json a GGUF converts to
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    a.gguf: (a.hf_class, a.gguf_model_type) for a in ARCHITECTURES
    if a.gguf is not None and a.gguf_model_type and not a.gguf_experts
}
# ... and for a GGUF of that general.architecture with experts ({arch}.expert_count > 0)
GGUF_EXPERT_ARCHITECTURES: dict[str, tuple[str, str]] = {
    a.gguf: (a.hf_class, a.gguf_model_type) for a in ARCHITECTURES if a.gguf is not None and a.gguf_experts
}

# HF model_type → the general.architecture a GGUF of it is written as (loader/gguf_writer.py)
GGUF_WRITE_ARCHITECTURES: dict[str, str] = {
    "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3",
    "phi3": "phi3", "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe",
}
assert set(GGUF_WRITE_ARCHITECTURES.values()) <= set(GGUF_ARCHITECTURES)
assert all(t in {m for a in ARCHITECTURES for m in a.model_types} for t in GGUF_WRITE_ARCHITECTURES)
