"""A model with a LoRA adapter in the store (a Modelfile's ADAPTER, Ollama's /api/create
`adapters`): created from a PEFT directory or a GGUF adapter, served under the adapter with the
tokens transformers + peft give, pushed to and pulled from a real OCI registry like any model."""

from __future__ import annotations

import ollama
import pytest

from pagoda import LLM, SamplingParams
from pagoda.store import create, manifests, oci_client
from pagoda.store.layout import default_layout, parse_ref
from pagoda.store.modelfile import ModelfileError, parse_modelfile
from tests.gguf_export import export_gguf
from tests.lora.adapters import make_peft_adapter, peft_greedy
from tests.server_process import start_server, stop_process
from tests.store.test_oci_client import _empty_store

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPT = "Adapters in the store"


@pytest.fixture(scope="module")
def f32_gguf(tiny_llama, tmp_path_factory):
    """The tiny Llama as an F32 GGUF: its weights exactly, so peft on the HF files is the reference."""
    return export_gguf(tiny_llama, tmp_path_factory.mktemp("f32") / "tiny-f32.gguf", "F32")


@pytest.fixture(scope="module")
def peft_dir(tiny_llama, tmp_path_factory):
    return make_peft_adapter(tiny_llama, tmp_path_factory.mktemp("peft") / "adapter", seed=7)


def _tokens(model: str) -> list[int]:
    llm = LLM(model=model, dtype="float32", kv_cache_memory=0.01)
    out = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    return out.prompt_token_ids, out.outputs[0].token_ids


def test_modelfile_adapter_serves_the_adapter_and_round_trips_a_registry(registry, fresh_home, monkeypatch,
                                                                        tiny_llama, f32_gguf, peft_dir):
    ref = parse_ref(f"{registry.host}/library/tiny-lora:1")
    _, manifest = create.create_model(str(ref), parse_modelfile(f"FROM {f32_gguf}\nADAPTER {peft_dir}\n"))
    assert manifest.layer(manifests.ADAPTER) is not None
    prompt_ids, tokens = _tokens(str(ref))
    assert tokens == peft_greedy(tiny_llama, peft_dir, [prompt_ids], MAX_TOKENS)[0]
    assert tokens != peft_greedy(tiny_llama, None, [prompt_ids], MAX_TOKENS)[0]

    oci_client.push(default_layout(), ref, insecure=True)
    layout = _empty_store(fresh_home, monkeypatch, "puller")
    oci_client.pull(layout, ref, insecure=True)
    assert manifests.read_manifest(layout, ref).digest == manifest.digest
    assert _tokens(str(ref))[1] == tokens

    # FROM the stored model: the adapter is inherited; a new ADAPTER line replaces it
    create.create_model("tiny-again", parse_modelfile(f"FROM {ref}\n"))
    assert _tokens("tiny-again")[1] == tokens


def test_adapter_for_another_base_names_the_line(fresh_home, f32_gguf, tmp_path):
    other_base = tmp_path / "other"
    from tests.tiny_models import make_tiny_hf_model

    make_tiny_hf_model("llama", other_base, intermediate_size=96)  # another MLP width
    foreign = make_peft_adapter(other_base, tmp_path / "foreign", seed=1)
    with pytest.raises(ModelfileError, match="line 2: ADAPTER .*trained for another base"):
        create.create_model("bad", parse_modelfile(f"FROM {f32_gguf}\nADAPTER {foreign}\n"))
    with pytest.raises(ModelfileError, match="line 3: a second ADAPTER"):
        parse_modelfile(f"FROM {f32_gguf}\nADAPTER {foreign}\nADAPTER {foreign}\n")


def test_ollama_create_with_an_uploaded_adapter(fresh_home, tiny_llama, f32_gguf, peft_dir, tmp_path):
    """The official ollama client: upload the model and a GGUF adapter as blobs, create with
    `adapters`, and the created model answers under the adapter."""
    from pagoda.lora.gguf_adapter_writer import write_gguf_adapter
    import json

    gguf_adapter = write_gguf_adapter(peft_dir, json.loads((tiny_llama / "config.json").read_text()),
                                      tmp_path / "adapter.gguf")
    proc, base = start_server(tiny_llama)
    try:
        client = ollama.Client(host=base)
        model_digest, adapter_digest = client.create_blob(f32_gguf), client.create_blob(gguf_adapter)
        client.create(model="tiny-ollama-lora", files={"tiny.gguf": model_digest},
                      adapters={"adapter.gguf": adapter_digest})
    finally:
        stop_process(proc)
    prompt_ids, tokens = _tokens("tiny-ollama-lora")
    assert tokens == peft_greedy(tiny_llama, peft_dir, [prompt_ids], MAX_TOKENS)[0]
