"""The "native PyTorch" serving baseline: transformers served naively, one request at a time.

    python -m pagoda.bench.hf_server --model smollm2-135m-instruct --port 8001

A minimal OpenAI-style ``/v1/completions`` (token-id or text prompt, max_tokens, stream,
``stream_options.include_usage``) around a plain transformers forward loop with its own KV cache:
greedy, no batching; concurrent requests wait for a lock. It runs on exactly the weights and dtype
pagoda loads for the same ``--model``. Measure it with ``pagoda bench serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagoda.bench.baselines import load_transformers_model
from pagoda.engine_args import EngineArgs


def build_app(model, tokenizer, name: str) -> FastAPI:
    import torch  # torch loads on first use

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
        max_tokens = int(body.get("max_tokens") or 16)
        usage = {"prompt_tokens": len(ids), "completion_tokens": max_tokens, "total_tokens": len(ids) + max_tokens}
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(token: int) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, token)

        task = loop.run_in_executor(None, generate, ids, max_tokens, emit)
        head = {"id": "cmpl-hf", "object": "text_completion", "created": int(time.time()), "model": name}

        async def stream():
            for i in range(max_tokens):
                token = await queue.get()
                finish = "length" if i == max_tokens - 1 else None
                chunk = {**head, "choices": [{"index": 0, "text": tokenizer.decode([token]), "finish_reason": finish}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            await task
            if (body.get("stream_options") or {}).get("include_usage"):
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        if body.get("stream"):
            return StreamingResponse(stream(), media_type="text/event-stream")
        tokens = [await queue.get() for _ in range(max_tokens)]
        await task
        return JSONResponse({**head, "choices": [{"index": 0, "text": tokenizer.decode(tokens), "finish_reason": "length"}],
                             "usage": usage})

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "transformers"}]}

    @app.get("/health")
    async def health():
        return {}

    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn  # deferred: uvicorn loads on first use

    from pagoda.config import create_engine_config  # deferred: loads torch
    from pagoda.tokenizer import Tokenizer  # deferred: loads tokenizers

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--served-model-name", default=None)
    args = ap.parse_args(argv)
    config = create_engine_config(EngineArgs(model=args.model, dtype=args.dtype))  # files and dtype as pagoda resolves them
    model = load_transformers_model(args.model, config.model.dtype)
    tokenizer = Tokenizer(config.model.files.metadata_dir)
    app = build_app(model, tokenizer, args.served_model_name or args.model)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
