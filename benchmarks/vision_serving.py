"""Image requests through `pagoda serve` (issue 46 item 1): image requests per second and TTFT at
1 and 8 concurrent streams, every request a new image; then the same image again (its tokens a
prefix-cache hit).

    python benchmarks/vision_serving.py [--requests 16] [--tokens 16] [--model DIR]

The model: a small random-weight Gemma 3 vision model (``--model`` names another directory): the
text model 6 layers of 256, a SigLIP tower of 6 layers of 384 on 224 px in 14 px patches (256
patches) pooled to 64 image tokens, fp32, built with transformers as tests/vision_models.py builds
the tests' model. The client: the openai package, streaming chat completions with one data: URL
PNG of 320 x 240 each, greedy, ``ignore_eos``. TTFT: from the request to the first content
chunk. Prints one JSON line per round.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def build_model(out: Path) -> Path:
    import transformers
    from vision_models import GEMMA3_IMAGE_TOKENS, GEMMA3_TEMPLATE, VISION_VOCAB, _perturb, _tokenizer

    out.mkdir(parents=True, exist_ok=True)
    _tokenizer(out, GEMMA3_IMAGE_TOKENS)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = transformers.Gemma3TextConfig(vocab_size=VISION_VOCAB, hidden_size=256, intermediate_size=1024,
                                         num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=64, sliding_window=512, max_position_embeddings=2048,
                                         eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    vision = transformers.SiglipVisionConfig(hidden_size=384, intermediate_size=1536, num_hidden_layers=6,
                                             num_attention_heads=6, image_size=224, patch_size=14,
                                             vision_use_head=False)
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in GEMMA3_IMAGE_TOKENS.items()}
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=64,
                                       boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
                                       image_token_index=ids["image_token"])
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    _perturb(model)
    model.save_pretrained(out, safe_serialization=True)
    processor = transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil(size={"height": 224, "width": 224}, image_mean=[0.5] * 3,
                                                             image_std=[0.5] * 3),
        tokenizer=tok, chat_template=GEMMA3_TEMPLATE, image_seq_length=64)
    processor.save_pretrained(out)
    return out


def data_url(seed: int) -> str:
    from vision_models import random_image

    buffer = io.BytesIO()
    random_image(seed, (320, 240)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


async def one(client, url: str, tokens: int) -> float:
    start = time.perf_counter()
    stream = await client.chat.completions.create(
        model="vision", stream=True, max_tokens=tokens, temperature=0.0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": "Describe the image."}]}])
    first = None
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
    return first if first is not None else float("nan")


async def round_(base: str, urls: list[str], concurrency: int, tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    gate = asyncio.Semaphore(concurrency)

    async def limited(url: str) -> float:
        async with gate:
            return await one(client, url, tokens)

    start = time.perf_counter()
    ttfts = await asyncio.gather(*(limited(u) for u in urls))
    elapsed = time.perf_counter() - start
    await client.close()
    return {"concurrency": concurrency, "requests": len(urls), "requests_per_s": round(len(urls) / elapsed, 3),
            "ttft_median_s": round(statistics.median(ttfts), 3), "ttft_max_s": round(max(ttfts), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--model", help="a vision-language model directory (default: the small random one)")
    args = parser.parse_args()
    from server_process import start_server, stop_process

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else build_model(Path(tmp) / "gemma3-vision-small")
        proc, base = start_server(model, name="vision")
        try:
            seed = 0
            for concurrency in (1, 8):
                urls = [data_url(seed + i) for i in range(args.requests)]
                seed += args.requests
                warm = [data_url(100_000 + seed + i) for i in range(2)]  # images of their own: no hit later
                asyncio.run(round_(base, warm, concurrency, args.tokens))  # warm-up (not counted)
                print(json.dumps({"images": "new", **asyncio.run(round_(base, urls, concurrency, args.tokens))}),
                      flush=True)
            same = [data_url(0)] * args.requests
            print(json.dumps({"images": "repeated", **asyncio.run(round_(base, same, 1, args.tokens))}), flush=True)
        finally:
            stop_process(proc)


if __name__ == "__main__":
    main()
