"""Gemma 3's vision path on a tiny random ``Gemma3ForConditionalGeneration`` (tests/vision_models.py):
greedy fp32 tokens and their logprobs equal transformers' for the same images and prompt, alone,
batched with each other and with text-only prompts, in chunks, and after prefix-cache hits;
an image's tokens attend to each other both ways (transformers' token_type_ids mask), which the
test shows matters."""

from __future__ import annotations

import pytest
from vision_models import (assert_matches_hf, chat_text, greedy_params, hf_greedy, image_prompt,
                           make_tiny_gemma3_vision, random_image, reference)

from pagoda import LLM

MAX_TOKENS = 8
LONG = "Paris is the capital of France. Berlin is the capital of Germany."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_gemma3_vision(tmp_path_factory.mktemp("gemma3-vision") / "m", seed=5)


@pytest.fixture(scope="module")
def hf(model_dir):
    return reference(model_dir)


def _cases(processor) -> list[tuple[str, list]]:
    """(prompt text, images): one image; two; an image after more text than the sliding window (12)."""
    one = chat_text(processor, [{"type": "image"}, {"type": "text", "text": "The quick brown fox"}])
    two = chat_text(processor, [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "text", "text": "and"},
                                {"type": "image"}, {"type": "text", "text": "please"}])
    late = chat_text(processor, [{"type": "text", "text": LONG}, {"type": "image"}, {"type": "text", "text": LONG}])
    return [(one, [random_image(1)]), (two, [random_image(2, (70, 20)), random_image(3, (25, 25), "RGBA")]),
            (late, [random_image(4, (90, 60), "L")])]


@pytest.fixture(scope="module")
def expected(hf):
    ref, processor = hf
    return [(text, images, hf_greedy(ref, processor, text, images, MAX_TOKENS)) for text, images in _cases(processor)]


@pytest.mark.parametrize("args", [{}, {"block_size": 8, "max_num_batched_tokens": 6}], ids=["whole", "chunked"])
def test_images_equal_transformers_alone_and_batched(model_dir, expected, args):
    """Each prompt alone, then all of them in one batch with two text-only prompts between them;
    chunked: a step of 6 tokens cuts every prompt, never inside an image's run of 4."""
    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_memory=0.02, enable_prefix_caching=False, **args)
    for text, images, want in expected:
        assert_matches_hf(llm.generate([image_prompt(text, images)], greedy_params(MAX_TOKENS), use_tqdm=False)[0], want)
    text_only = ["The quick brown fox", LONG]
    outs = llm.generate([image_prompt(t, i) for t, i, _ in expected] + text_only, greedy_params(MAX_TOKENS), use_tqdm=False)
    for out, (_, _, want) in zip(outs, expected):
        assert_matches_hf(out, want)
    alone = llm.generate(text_only, greedy_params(MAX_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[len(expected):]] == [o.outputs[0].token_ids for o in alone]
    encoder = llm.engine.core.runner.images
    before = encoder.encoder_batches
    llm.generate([image_prompt(t, i) for t, i, _ in expected], greedy_params(MAX_TOKENS), use_tqdm=False)
    if not args:  # whole prompts: the four images of one step went through the tower as one batch
        assert encoder.encoder_batches - before == 1


def test_token_ids_with_one_marker_per_image(model_dir, expected, hf):
    """A prompt of token ids holding one <start_of_image> id per image expands as the text does."""
    _, processor = hf
    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_memory=0.02)
    text, images, want = expected[1]
    ids = processor.tokenizer(text, add_special_tokens=True)["input_ids"]
    out = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images}}], greedy_params(MAX_TOKENS), use_tqdm=False)
    assert_matches_hf(out[0], want)


def test_the_image_and_its_mask_matter(hf, expected):
    """Another image, or the image's tokens attending causally only, changes transformers' answer:
    the tests above check both."""
    ref, processor = hf
    text, images, (_, tokens, logprobs) = expected[0]
    _, other_tokens, other = hf_greedy(ref, processor, text, [random_image(9)], MAX_TOKENS)
    _, _, causal = hf_greedy(ref, processor, text, images, MAX_TOKENS, bidirectional=False)
    assert max(abs(a - b) for a, b in zip(logprobs, other)) > 1e-3
    assert max(abs(a - b) for a, b in zip(logprobs, causal)) > 1e-3


def test_prefix_cache_keys_images_by_their_pixels(model_dir, expected, hf):
    """The same prompt and image again is a hit through the image; the same text with another
    image reuses only the blocks before the image, and its answer is that image's."""
    ref, processor = hf
    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_memory=0.02, block_size=8)
    text, images, want = expected[2]  # 16+ tokens of text before the image: two blocks
    first = llm.generate([image_prompt(text, images)], greedy_params(MAX_TOKENS), use_tqdm=False)[0]
    again = llm.generate([image_prompt(text, images)], greedy_params(MAX_TOKENS), use_tqdm=False)[0]
    assert_matches_hf(first, want)
    assert_matches_hf(again, want)
    image = next(i for i, t in enumerate(want[0]) if t == processor.tokenizer.image_token_id)
    assert again.num_cached_tokens > image + 4  # past the image's run
    other = [random_image(11, (90, 60), "L")]
    out = llm.generate([image_prompt(text, other)], greedy_params(MAX_TOKENS), use_tqdm=False)[0]
    assert 0 < out.num_cached_tokens <= image  # the text before the image only
    assert_matches_hf(out, hf_greedy(ref, processor, text, other, MAX_TOKENS))


def test_the_hubs_config_reads_with_transformers_defaults():
    """google/gemma-3-4b-it's config.json names only what differs from the defaults."""
    from pagoda.models.gemma3_vision import Gemma3ForConditionalGeneration
    from pagoda.models.vision_config import language_view

    hub = {"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
           "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02,
           "mm_tokens_per_image": 256, "model_type": "gemma3",
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                             "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                             "patch_size": 14, "vision_use_head": False}}
    view = language_view(hub)
    cfg = Gemma3ForConditionalGeneration.read_config(view)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2560, 34, 8, 4, 256)
    assert cfg.vocab_size == 262_208 and cfg.sliding_windows[:6] == (1024,) * 5 + (None,)
    assert cfg.rope_scaling["factor"] == 8.0 and view["image_token_id"] == 262144
    assert view["vision_config"]["layer_norm_eps"] == 1e-6 and view["architectures"] == hub["architectures"]


def test_the_towers_attention_in_chunks_of_patches(model_dir, expected, monkeypatch):
    """PAGODA_VISION_ATTENTION_CHUNK: 16 patches as query chunks of 5, 5, 5 and 1, the same answers."""
    monkeypatch.setenv("PAGODA_VISION_ATTENTION_CHUNK", "5")
    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_memory=0.02)
    assert llm.engine.core.model.vision_tower.attention_chunk == 5
    outs = llm.generate([image_prompt(t, i) for t, i, _ in expected], greedy_params(MAX_TOKENS), use_tqdm=False)
    for out, (_, _, want) in zip(outs, expected):
        assert_matches_hf(out, want)


def test_tensor_parallelism_is_refused_clearly(model_dir):
    import json

    from pagoda.config import check_tensor_parallel
    from pagoda.models.vision_config import language_view

    with pytest.raises(ValueError, match="vision-language model runs on one rank"):
        check_tensor_parallel(2, language_view(json.loads((model_dir / "config.json").read_text())))


def test_llm_chat_takes_vllms_image_parts(model_dir, expected):
    """LLM.chat with an image_url part (a data: URL) and an image_pil part: the template's image
    markers, placed as the processor places them (the chat template writes its own specials)."""
    import base64
    import io

    text, images, want = expected[1]  # "Compare <image> and <image> please"
    buffer = io.BytesIO()
    images[0].save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_memory=0.02)
    content = [{"type": "text", "text": "Compare"}, {"type": "image_url", "image_url": {"url": url}},
               {"type": "text", "text": "and"}, {"type": "image_pil", "image_pil": images[1]},
               {"type": "text", "text": "please"}]
    out = llm.chat([{"role": "user", "content": content}], greedy_params(MAX_TOKENS), use_tqdm=False)[0]
    assert_matches_hf(out, want)  # (the PNG round trip keeps the RGB pixels; the RGBA one went as a PIL image)


def test_preempted_image_requests_answer_the_same(model_dir, hf):
    """A KV budget of 48 blocks for six image prompts of 24 tokens each: requests are preempted
    and recomputed (their images encoded again) and answer as with room to spare."""
    from pagoda import SamplingParams

    _, processor = hf
    prompts = [image_prompt(chat_text(processor, [{"type": "image"}, {"type": "text", "text": f"The quick fox {i}"}]),
                            [random_image(40 + i)]) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    roomy = LLM(model=str(model_dir), dtype="float32", kv_cache_memory=0.02)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    block = 2 * 4 * 16 * 2 * 32 * 4  # K+V, layers, block, kv heads, head dim, fp32
    small = LLM(model=str(model_dir), dtype="float32", kv_cache_memory=12 * block / 2**30)
    assert [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)] == want
    assert small.engine.core.scheduler.num_preemptions_total > 0
