"""The baseline for serve_bench.py: transformers served naively, one request at a time.

    python benchmarks/hf_naive_server.py --model smollm2-135m-instruct --port 8001

A minimal OpenAI-style `/v1/completions` (token-id or text prompt, max_tokens, stream) around a
plain transformers forward loop with its own KV cache: greedy, no batching; concurrent requests
wait for a lock. This is what "native PyTorch" serving looks like in the seed's table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def load(model: str, dtype: str):
    from throughput import load_transformers_model

    from pagoda import LLM

    llm = LLM(model=model, dtype=dtype, kv_cache_memory=0.01)  # resolves files and dtype exactly like pagoda
    return load_transformers_model(llm, llm.engine.config.model.dtype), llm.get_tokenizer()


def build_app(model, tokenizer) -> FastAPI:
    app = FastAPI()
    lock = threading.Lock()

    def generate(ids: list[int], max_tokens: int, emit) -> None:
        with lock, torch.inference_mode():
            past, inp = None, torch.tensor([ids])
            for _ in range(max_tokens):
                out = model(input_ids=inp, past_key_values=past, use_cache=True)
                past = out.past_key_values
                token = int(out.logits[0, -1].argmax())
                emit(token)
                inp = torch.tensor([[token]])

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        prompt = body["prompt"]
        ids = prompt if isinstance(prompt, list) else tokenizer.encode(prompt)
        max_tokens = int(body.get("max_tokens", 16))
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(token: int) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, token)

        task = loop.run_in_executor(None, generate, ids, max_tokens, emit)
        created = int(time.time())

        async def stream():
            for i in range(max_tokens):
                token = await queue.get()
                finish = "length" if i == max_tokens - 1 else None
                chunk = {"id": "cmpl-hf", "object": "text_completion", "created": created, "model": "hf",
                         "choices": [{"index": 0, "text": tokenizer.decode([token]), "finish_reason": finish}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            await task
            yield "data: [DONE]\n\n"

        if body.get("stream"):
            return StreamingResponse(stream(), media_type="text/event-stream")
        tokens = []
        for _ in range(max_tokens):
            tokens.append(await queue.get())
        await task
        return JSONResponse({"choices": [{"index": 0, "text": tokenizer.decode(tokens), "finish_reason": "length"}]})

    @app.get("/health")
    async def health():
        return {}

    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--port", type=int, default=8001)
    args = ap.parse_args()
    model, tokenizer = load(args.model, args.dtype)
    uvicorn.run(build_app(model, tokenizer), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
