"""GGUF files in the super-block formats (a Q4_K_M file's mix: Q4_K, Q5_K and Q6_K; IQ4_XS / IQ4_NL)
served on their own blocks: every projection, the tied embedding and the output head stay packed,
hold the file's weights exactly, and the engine's greedy output is that of the same file's
dequantized weights."""

from __future__ import annotations

import pytest
import torch
from superblock_data import block_tensors
from tiny_models import make_tiny_hf_model

from pagoda import LLM, SamplingParams
from pagoda.layers.cpu_kernels import load_cpu_kernels
from pagoda.layers.superblocks import SuperBlockEmbedding, SuperBlockLinear
from pagoda.loader.gguf_packed_weight import GGUFPackedWeight
from pagoda.loader.gguf_writer import write_gguf
from pagoda.loader.gguf_writer_tensors import _hf_tensors
from pagoda.loader import model_loader
from pagoda.loader.model_loader import load_model
from pagoda.loader.resolve import resolve_model

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="pagoda's C++ kernels cannot be built here")

# A Q4_K_M file's choices (llama.cpp's llama-quantize): Q6_K for attn_v, half the ffn_down and the
# tied embedding, Q4_K elsewhere; here Q5_K for ffn_down, so one file holds all three.
MIXES = {
    "k-quants": {"v_proj": "Q6_K", "down_proj": "Q5_K", "embed_tokens": "Q6_K", "*": "Q4_K"},
    "iq4": {"v_proj": "IQ4_NL", "embed_tokens": "Q4_K", "*": "IQ4_XS"},
}
PROMPTS = ["The quick brown fox", "Paris is the capital of", "def main():"]
LOGPROB_BOUND = 0.1  # mean |logprob difference|, packed against dequantized (see the test)


@pytest.fixture(scope="module")
def superblock_ggufs(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("superblocks")
    # K-quants need rows of whole 256-element super-blocks: hidden 256, intermediate 512
    hf = make_tiny_hf_model("llama", root / "hf", hidden_size=256, intermediate_size=512, head_dim=64,
                            tie_word_embeddings=True)
    return {name: write_gguf(hf, root / f"{name}.gguf", "F32", tensors=block_tensors(_hf_tensors(hf), mix, seed=i))
            for i, (name, mix) in enumerate(MIXES.items())}


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_every_weight_stays_packed_and_holds_the_files_values(mix, superblock_ggufs):
    files = resolve_model(str(superblock_ggufs[mix]))
    config = files.hf_config()
    reference = load_model(files, config, torch.float32, torch.device("cpu"), 64)
    model = load_model(files, config, torch.float32, torch.device("cpu"), 64, quantization="gguf")
    floats = dict(reference.named_modules())
    packed = {name: m for name, m in model.named_modules() if isinstance(m, SuperBlockLinear)}
    assert len(packed) == 2 * 4 + 1  # merged qkv and gate/up of both layers, and the tied head
    for name, layer in packed.items():
        expected = floats["embed_tokens"].weight if name == "lm_head" else floats[name].weight
        assert torch.equal(layer.dequantize(), expected), name
    qkv = packed["layers.0.self_attn.qkv_proj"]
    assert qkv.types == (["Q4_K", "Q6_K"] if mix == "k-quants" else ["IQ4_XS", "IQ4_NL"])  # one weight, two parts
    assert isinstance(model.embed_tokens, SuperBlockEmbedding)
    assert model.embed_tokens.blocks is model.lm_head.blocks  # tied: one packed copy
    ids = torch.tensor([[3, 7], [100, 0]])
    assert torch.equal(model.embed_tokens(ids), reference.embed_tokens(ids))


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_scores_stay_close_to_the_dequantized_weights(mix, superblock_ggufs):
    """fp32's greedy continuations on the dequantized weights, scored on the packed weights
    (teacher-forced): the kernels' int8 activations move a logprob by little (random tiny models
    have near-ties, so greedy tokens alone would not be a fair bound); and the packed path's own
    greedy output is the same batched as one prompt at a time."""
    args = {"dtype": "float32", "kv_cache_memory": 0.02}
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    exact = [o.outputs[0] for o in LLM(str(superblock_ggufs[mix]), **args).generate(PROMPTS, greedy)]
    fast = LLM(str(superblock_ggufs[mix]), quantization="gguf", enable_prefix_caching=False, **args)
    assert sum(isinstance(m, SuperBlockLinear) for m in fast.engine.core.model.modules()) == 2 * 4 + 1
    batched = [o.outputs[0].token_ids for o in fast.generate(PROMPTS, greedy)]
    assert batched == [fast.generate([p], greedy)[0].outputs[0].token_ids for p in PROMPTS]
    tokenizer = fast.get_tokenizer()
    ids = [tokenizer.encode(p, add_special_tokens=False) + list(o.token_ids) for p, o in zip(PROMPTS, exact)]
    scored = fast.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(max_tokens=1, prompt_logprobs=0))
    diffs = []
    for out, want in zip(scored, exact):
        got = [pos[t].logprob for t, pos in zip(want.token_ids, out.prompt_logprobs[-len(want.token_ids):])]
        diffs += [abs(a - pos[t].logprob) for a, t, pos in zip(got, want.token_ids, want.logprobs)]
    # int8 activations per block of 32 put an error of ~1/200 of a logit's spread on each logit;
    # these random models' logits spread widely, and the mean moved by 0.03-0.05 (measured). A
    # wrongly wired part, row order or permutation moves it by more than 1.
    assert sum(diffs) / len(diffs) < LOGPROB_BOUND


def test_repacked_weights_are_kept_for_the_next_start(superblock_ggufs, tmp_path, monkeypatch):
    """The first load repacks and writes every super-block weight; the next maps them (the GGUF's
    blocks unread) and holds the same bytes; a damaged file is repacked and written again."""
    where = tmp_path / "repacked"
    monkeypatch.setattr(model_loader, "cache_directory", lambda path, rank, size: where)
    files = resolve_model(str(superblock_ggufs["k-quants"]))
    config = files.hf_config()

    def load():
        return load_model(files, config, torch.float32, torch.device("cpu"), 64, quantization="gguf")

    first = load()
    kept = sorted(where.glob("*.tiles"))
    assert len(kept) == 2 * 4 + 1  # qkv, o, gate_up, down of both layers, and the tied embedding
    monkeypatch.setattr(GGUFPackedWeight, "ggml_blocks", lambda self: pytest.fail("read the GGUF's blocks again"))
    second = load()
    for (name, a), b in zip(first.named_buffers(), second.buffers()):
        assert torch.equal(a, b), name
    damaged = next(p for p in kept if p.name.startswith("layers.1.mlp.down_proj"))
    damaged.write_bytes(damaged.read_bytes()[:-10])
    monkeypatch.undo()
    monkeypatch.setattr(model_loader, "cache_directory", lambda path, rank, size: where)
    third = load()
    assert torch.equal(third.layers[1].mlp.down_proj.blocks, first.layers[1].mlp.down_proj.blocks)
    assert damaged.stat().st_size == first.layers[1].mlp.down_proj.blocks.numel()  # written again, whole


def test_the_cache_is_per_tensor_parallel_slice_and_off_when_asked(superblock_ggufs, monkeypatch):
    from pagoda.loader.repacked_cache import cache_directory

    path = superblock_ggufs["k-quants"]
    assert cache_directory(path) != cache_directory(path, 1, 2)  # a tensor-parallel rank's slice apart
    monkeypatch.setenv("PAGODA_REPACK_CACHE", "0")
    assert cache_directory(path) is None
