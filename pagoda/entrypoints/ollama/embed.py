"""Ollama's embedding routes on the pooling runner: `/api/embed` (`input`: a text or texts →
`embeddings`, with `truncate`, default true: a text too long for the model is cut to fit, its
special tokens kept; false: refused) and the older `/api/embeddings` (`prompt` → `embedding`).
They run through the same `Serving.encode_all` as /v1/embeddings, with Ollama's errors."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request

from pagoda.entrypoints.disconnect import GONE, unless_disconnected
from pagoda.entrypoints.input_limits import MAX_PROMPTS, check_count
from pagoda.entrypoints.ollama.common import OllamaError, _Body, json_response, ollama_errors, read_body
from pagoda.entrypoints.ollama.generation import served_name, serving_of
from pagoda.entrypoints.openai.lifecycle import check_serving
from pagoda.entrypoints.openai.protocol import random_id
from pagoda.pooling_params import PoolingParams

router = APIRouter()


class EmbedBody(_Body):
    model: str = ""
    input: Any = None
    truncate: bool = True
    dimensions: int | None = None
    options: dict[str, Any] | None = None  # accepted; nothing in them changes a vector
    keep_alive: float | str | None = None  # accepted; the served model stays loaded


class EmbeddingsBody(_Body):
    model: str = ""
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None


def _texts(value: Any) -> list[str]:
    """`input`: a string or a non-empty list of non-empty strings."""
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise OllamaError("input must be a string or a non-empty list of strings")
    check_count(texts, "input", MAX_PROMPTS, "inputs")
    if any(not t for t in texts):
        raise OllamaError("input holds an empty text: every input needs at least one token")
    return texts


async def _embed(request: Request, texts: list[str], params: PoolingParams):
    """The served model's vectors of ``texts`` under the server's admission (None: the client left)."""
    serving = serving_of(request)
    check_serving(request.app.state.lifecycle, serving.engine)
    admission = serving.admission()
    try:
        serving.check_capacity(len(texts), admission)
        outputs = await unless_disconnected(request, serving.encode_all(texts, params, random_id("embed")))
        return None if outputs is GONE else outputs
    finally:
        admission.release()


@router.post("/api/embed")
@ollama_errors
async def embed(request: Request):
    start = time.perf_counter_ns()
    body = await read_body(request, EmbedBody)
    model = served_name(serving_of(request), body.model)
    params = PoolingParams(dimensions=body.dimensions, truncate_prompt_tokens=-1 if body.truncate else None)
    outputs = await _embed(request, _texts(body.input), params)
    if outputs is None:
        return json_response({})
    return json_response({"model": model, "embeddings": [o.outputs.data.tolist() for o in outputs],
                          "total_duration": time.perf_counter_ns() - start, "load_duration": 0,
                          "prompt_eval_count": sum(len(o.prompt_token_ids) for o in outputs)})


@router.post("/api/embeddings")
@ollama_errors
async def embeddings(request: Request):
    body = await read_body(request, EmbeddingsBody)
    served_name(serving_of(request), body.model)
    if not body.prompt:  # Ollama's answer to an empty prompt: no vector
        return json_response({"embedding": []})
    outputs = await _embed(request, [body.prompt], PoolingParams(truncate_prompt_tokens=-1))
    return json_response({"embedding": outputs[0].outputs.data.tolist() if outputs else []})
