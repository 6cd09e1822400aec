"""LLaVA on a tiny random ``LlavaForConditionalGeneration`` (tests/vision_models.py: a Llama under a
CLIP tower, features from its second-to-last layer): greedy fp32 tokens and their logprobs equal
transformers' for the same images and prompt, alone and batched with text-only prompts, in
chunks, after a prefix-cache hit, for both feature strategies (the class token dropped or kept),
and with two images side by side (their runs meet)."""

from __future__ import annotations

import pytest
from vision_models import (assert_matches_hf, chat_text, greedy_params, hf_greedy, image_prompt, make_tiny_llava,
                           random_image, reference)

from pagoda import LLM

MAX_TOKENS = 8


@pytest.fixture(scope="module", params=["default", "full"])
def model(request, tmp_path_factory):
    path = make_tiny_llava(tmp_path_factory.mktemp(f"llava-{request.param}") / "m", seed=3, strategy=request.param)
    ref, processor = reference(path, "LlavaForConditionalGeneration")
    one = chat_text(processor, [{"type": "image"}, {"type": "text", "text": "The quick brown fox"}])
    side = chat_text(processor, [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "image"}])
    cases = [(one, [random_image(1, (50, 30))]), (side, [random_image(2, (20, 60), "RGBA"), random_image(3)])]
    return path, [(text, images, hf_greedy(ref, processor, text, images, MAX_TOKENS)) for text, images in cases]


@pytest.mark.parametrize("args", [{}, {"block_size": 8, "max_num_batched_tokens": 20}], ids=["whole", "chunked"])
def test_llava_equals_transformers(model, args):
    path, expected = model
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory=0.02, **args)
    prompts = [image_prompt(text, images) for text, images, _ in expected]
    for prompt, (_, _, want) in zip(prompts, expected):
        assert_matches_hf(llm.generate([prompt], greedy_params(MAX_TOKENS), use_tqdm=False)[0], want)
    outs = llm.generate(prompts + ["The quick brown fox"], greedy_params(MAX_TOKENS), use_tqdm=False)
    for out, (_, _, want) in zip(outs, expected):
        assert_matches_hf(out, want)
    again = llm.generate(prompts[:1], greedy_params(MAX_TOKENS), use_tqdm=False)[0]  # through the image: a hit
    assert_matches_hf(again, expected[0][2])
    assert again.num_cached_tokens > expected[0][2][0].index(llm.engine.core.model.image_token_id)
