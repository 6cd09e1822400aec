"""The pooling runner's routes, in vLLM's shapes: POST /v1/embeddings (OpenAI's), /v1/score
(vLLM's: a cross-encoder's score of each pair, or the cosine similarity of two texts'
embeddings), /v1/rerank, /rerank and /v2/rerank (Jina's
and Cohere's, as vLLM serves them). Each runs its texts through `Serving.encode_all` (pooling.py)
under the server's admission, as the generation routes run theirs through `respond`."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagoda.engine.scoring import score_pairs
from pagoda.entrypoints.disconnect import GONE, unless_disconnected
from pagoda.entrypoints.openai.errors import OpenAIError, bad_value
from pagoda.entrypoints.openai.lifecycle import check_serving
from pagoda.entrypoints.openai.middleware import FastJSONResponse
from pagoda.entrypoints.openai.pooling import encode_vector, pair_scores
from pagoda.entrypoints.openai.pooling_protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from pagoda.entrypoints.openai.protocol import random_id
from pagoda.entrypoints.openai.serving import Serving

router = APIRouter()


async def answer(request: Request, n: int, work: Callable[[Serving], Awaitable[dict]]) -> Response:
    """``work``'s JSON body, with its ``n`` engine requests admitted against the server's queue
    and the tenant's limits until it is done; a client that leaves first aborts them."""
    serving: Serving = request.app.state.serving
    check_serving(request.app.state.lifecycle, serving.engine)
    admission = serving.admission()
    try:
        serving.check_capacity(n, admission)
        result = await unless_disconnected(request, work(serving))
        return FastJSONResponse(result) if result is not GONE else Response(status_code=499)
    except ValueError as e:  # PoolingParams' checks: the message names the field
        raise bad_value(e) from None
    finally:
        admission.release()


def _usage(outputs) -> dict:
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def _inputs(body: EmbeddingRequest) -> list:
    return [body.input] if isinstance(body.input, str) or type(body.input[0]) is int else body.input


async def embed_answer(serving: Serving, body: EmbeddingRequest) -> dict:
    """/v1/embeddings' answer to `body` (shared with the Batch API's lines)."""
    name = serving.check_model(body.model)
    params = body.pooling_params("embed", dimensions=body.dimensions, normalize=body.normalize)
    outputs = await serving.encode_all(_inputs(body), params, random_id("embd"), body.priority)
    data = [{"object": "embedding", "index": i, "embedding": encode_vector(o.outputs.data, body.encoding_format)}
            for i, o in enumerate(outputs)]
    return {"id": random_id("embd"), "object": "list", "created": int(time.time()), "model": name, "data": data,
            "usage": _usage(outputs)}


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request):
    return await answer(request, len(_inputs(body)), lambda serving: embed_answer(serving, body))


async def _scores(serving: Serving, pairs: list[tuple[str, str]], body, param: str):
    return await pair_scores(serving, pairs, body.pooling_params("score"), random_id("score"), body.priority, param)


@router.post("/v1/score")
async def score(body: ScoreRequest, request: Request):
    try:
        pairs = score_pairs(body.text_1, body.text_2)
    except ValueError as e:
        raise OpenAIError(str(e), param=str(e).split(" ", 1)[0]) from None

    async def work(serving: Serving) -> dict:
        name = serving.check_model(body.model)
        scores, outputs = await _scores(serving, pairs, body, "text_2")
        return {"id": random_id("score"), "object": "list", "created": int(time.time()), "model": name,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": _usage(outputs)}

    return await answer(request, len(set(t for pair in pairs for t in pair)), work)


@router.post("/v1/rerank")
@router.post("/rerank")
@router.post("/v2/rerank")
async def rerank(body: RerankRequest, request: Request):
    if body.top_n is not None and body.top_n < 0:
        raise OpenAIError(f"top_n must be >= 0, got {body.top_n}", param="top_n")

    async def work(serving: Serving) -> dict:
        name = serving.check_model(body.model)
        scores, outputs = await _scores(serving, [(body.query, d) for d in body.documents], body, "documents")
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n or None]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": body.documents[i]}} if body.return_documents else {})} for i in order]
        return {"id": random_id("rerank"), "model": name, "usage": {"total_tokens": _usage(outputs)["total_tokens"]},
                "results": results}

    return await answer(request, len(set(body.documents)) + 1, work)
