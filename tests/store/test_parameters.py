"""A store model's PARAMETERs are its default sampling parameters (through the overlay's
generation_config.json, pagoda/generation_defaults.py)."""

from __future__ import annotations

from pagoda import LLM
from pagoda.store import create
from pagoda.store.modelfile import parse_modelfile


def test_a_store_models_parameters_become_its_defaults(fresh_home, tiny_gguf, tmp_path):
    modelfile = parse_modelfile(f"FROM {tiny_gguf}\nPARAMETER temperature 0\nPARAMETER num_predict 4\n"
                                "PARAMETER top_k 5\n")
    create.create_model("params:v1", modelfile)
    llm = LLM(model="params:v1", kv_cache_memory=0.01)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens, defaults.top_k) == (0.0, 4, 5)
    [out] = llm.generate(["hello there"])
    assert len(out.outputs[0].token_ids) == 4
