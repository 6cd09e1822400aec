"""Serving's pooling path (a part of `Serving`): prompts through the engine's pooling runner
(`AsyncLLM.encode`), all at once so the scheduler batches them, under the same checks as a
generation request: the model, the queue and the tenant's limits, the text's size, the content
filter, the request timeout. Shared by /v1/embeddings, /v1/score, /v1/rerank, Ollama's /api/embed
and gRPC's Embed; each turns the vectors into its own body."""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Sequence

import numpy as np

from pagoda.engine.async_llm import EngineUnavailableError, ShuttingDownError
from pagoda.engine.scoring import cosine
from pagoda.entrypoints.openai.errors import OpenAIError, bad_value
from pagoda.outputs import PoolingRequestOutput
from pagoda.pooling_params import PoolingParams
from pagoda.security.context import request_context

logger = logging.getLogger("pagoda.requests")

PoolingInput = str | list[int]  # a text, or its token ids


class PoolingServing:
    """Serving's pooling requests (the attributes are `Serving`'s own)."""

    def check_runner(self, wanted: str) -> None:
        """400 for a request the model's runner does not serve (an embedding to a generating model,
        a completion to an embedding model), naming `model`."""
        try:
            self.engine.check_runner(wanted)
        except ValueError as e:
            raise OpenAIError(str(e), param="model", code="wrong_model_kind") from None

    def check_pooling(self, params: PoolingParams) -> None:
        """The model pools (its runner), and can give what ``params`` asks (``dimensions``; a
        cross-encoder scores pairs and gives no embeddings)."""
        self.check_runner("pooling")
        model = self.engine.config.model
        if model.cross_encoder and params.task != "score":
            raise OpenAIError(f"{model.architecture} is a cross-encoder: it scores text pairs (/v1/score, /v1/rerank) "
                              "and gives no embeddings", param="model", code="wrong_model_kind")
        try:
            params.check_against(model.pooler, int(model.hf_config.get("hidden_size", 0)))
        except ValueError as e:
            raise OpenAIError(str(e), param="dimensions") from None

    async def encode_all(self, inputs: Sequence[PoolingInput], params: PoolingParams, request_id: str,
                         priority: int = 0, param: str = "input") -> list[PoolingRequestOutput]:
        """Each input's vector, in order. Checked first (a 400 naming ``param``), then run
        concurrently; one that fails fails the request and the others are aborted."""
        self.check_pooling(params)
        texts = [x for x in inputs if isinstance(x, str)]
        for text in texts:
            self.check_prompt_chars(len(text), param)
        if texts:
            self.check_input(texts, param)
        ctx = request_context()  # auth: the role's priority; the audit's token counts
        if ctx is not None:
            priority, _ = ctx.engine_args(priority, None)

        async def one(i: int, prompt: PoolingInput) -> PoolingRequestOutput:
            prompt = {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt
            async for out in self.engine.encode(prompt, params, f"{request_id}-{i}", priority):
                if ctx is not None:
                    ctx.on_engine_done(i, out.prompt_token_ids, 0, 0, self.tokenizer)
                return out
            raise OpenAIError("the engine gave no output", status=500, type_="server_error")

        tasks = [asyncio.ensure_future(one(i, x)) for i, x in enumerate(inputs)]
        try:
            work = asyncio.gather(*tasks)
            outputs = await (work if self.request_timeout is None else
                             self._before(asyncio.get_running_loop().time() + self.request_timeout, work))
        except ValueError as e:  # the engine's checks: too long, bad token ids
            raise OpenAIError(str(e), param=bad_value(e).param or param,
                              code="context_length_exceeded" if "max_model_len" in str(e) else None) from None
        except EngineUnavailableError as e:
            code = "shutting_down" if isinstance(e, ShuttingDownError) else "engine_unavailable"
            raise OpenAIError(str(e), status=503, type_="server_error", code=code) from None
        finally:
            for task in tasks:
                task.cancel()
        logger.info("request %s: %d inputs pooled, %d tokens", request_id, len(outputs),
                    sum(len(o.prompt_token_ids) for o in outputs))
        return outputs


async def pair_scores(serving, pairs: list[tuple[str, str]], params: PoolingParams, request_id: str, priority: int,
                      param: str) -> tuple[list[float], list[PoolingRequestOutput]]:
    """Each pair's score, and the outputs (for usage): a cross-encoder reads each pair as one
    prompt and scores it; an embedding model embeds each distinct text once, and the score is
    the cosine of the two vectors (as vLLM scores with either)."""
    model = serving.engine.config.model
    if not model.cross_encoder:
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        outputs = await serving.encode_all(texts, params, request_id, priority, param)
        vectors = {t: o.outputs.data for t, o in zip(texts, outputs)}
        return [cosine(vectors[a], vectors[b]) for a, b in pairs], outputs
    if model.hf_config.get("num_labels", 1) != 1:
        raise OpenAIError(f"{model.architecture} has {model.hf_config['num_labels']} labels: scores come from a "
                          "one-label cross-encoder", param="model")
    texts = [t for pair in pairs for t in pair]
    for text in texts:
        serving.check_prompt_chars(len(text), param)
    serving.check_input(texts, param)  # the content filter, before the pairs go in as token ids
    prompts = [serving.tokenizer.encode_pair(a, b) for a, b in pairs]
    outputs = await serving.encode_all(prompts, params, request_id, priority, param)
    return [float(o.outputs.data[0]) for o in outputs], outputs


def encode_vector(vector, encoding_format: str) -> list[float] | str:
    """A vector as the embeddings API returns it: floats, or base64 of its little-endian float32
    bytes (what the openai SDK asks for and decodes)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector.tolist()
