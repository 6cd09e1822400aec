"""/v1/completions: prompts (text, token ids, several at once) to engine requests, and the
engine's outputs to completion choices, streamed or whole, with echo and logprobs."""

from __future__ import annotations

import asyncio

from pagoda.entrypoints.openai.admission import Admission
from pagoda.entrypoints.openai.beam_requests import beam_search_params, beam_width, check_best_of
from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.entrypoints.openai.protocol import CompletionRequest, now, random_id
from pagoda.entrypoints.openai.response_parts import Sample, sse, top_k, usage
from pagoda.outputs import PositionLogprobs


class CompletionServing:
    """Serving's completions (a part of `Serving`: the attributes are its own)."""

    def _completion_prompts(self, request: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        p = request.prompt
        if isinstance(p, str):
            items: list = [p]
        elif isinstance(p, list) and p and all(isinstance(x, int) for x in p):
            items = [p]
        elif isinstance(p, list) and p:
            items = p
        else:
            raise OpenAIError("prompt must be a non-empty string, list of strings, or token ids", param="prompt")
        for item in items:  # every prompt's size before tokenizing any
            if isinstance(item, str):
                self.check_prompt_chars(len(item))
        # the content filter; token ids are checked as the text they decode to (decoded only if a list applies)
        self.check_input(item if isinstance(item, str) else _decoded(self.tokenizer, item) for item in items)
        out = []
        for item in items:
            if isinstance(item, str):
                out.append((item, self.tokenizer.encode(item)))
            else:
                ids = list(item)
                if not ids:
                    raise OpenAIError("prompt token ids must not be empty", param="prompt")
                out.append((None, ids))
        return out

    def prepare_completion(self, request: CompletionRequest):
        """Check a completion request and make its engine inputs: (served model name, prompts as
        (text, token ids), sampling parameters per prompt). Shared with the gRPC service."""
        model = self.check_model(request.model)
        if request.logprobs is not None and not 0 <= request.logprobs <= 20:
            raise OpenAIError(f"logprobs must be in [0, 20], got {request.logprobs}", param="logprobs")
        check_best_of(request)
        prompts = self._completion_prompts(request)
        params_list = []
        for _, ids in prompts:
            max_tokens = self.max_tokens_for(request.max_tokens, len(ids))
            if request.use_beam_search:
                params_list.append(beam_search_params(request, max_tokens))
                continue
            prompt_lp = request.logprobs if (request.echo and request.logprobs is not None) else None
            params_list.append(self.params(request, max_tokens, request.logprobs, prompt_lp))
        return model, prompts, params_list

    async def completion(self, request: CompletionRequest, admission: Admission | None = None):
        # Off the event loop: tokenizing and a structured-output grammar take time in proportion to the body.
        model, prompts, params_list = await asyncio.to_thread(self.prepare_completion, request)
        self.check_capacity(len(prompts) * beam_width(request), admission)  # a beam search runs its width
        request_id = random_id("cmpl")
        n = request.n
        ids_only = [ids for _, ids in prompts]
        if request.stream:
            return self._completion_stream(request, model, request_id, prompts, ids_only, params_list)
        samples, prompt_logprobs, cached = await self._collect(ids_only, params_list, request_id, request, model=model)
        choices, completion_tokens = [], 0
        for i, (text, ids) in enumerate(prompts):
            for j in range(n):
                sample = samples.get((i, j), Sample())
                completion_tokens += len(sample.token_ids)
                choice_text = sample.text
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self._completion_logprobs(sample.token_ids, sample.logprobs, request.logprobs)
                if request.echo:
                    prompt_text = text if text is not None else self.tokenizer.decode(ids)
                    choice_text = prompt_text + choice_text
                    if logprobs is not None:
                        echoed = prompt_logprobs.get(i) or [None] * len(ids)
                        logprobs = _merge(self._completion_logprobs(ids, echoed, request.logprobs), logprobs)
                choices.append({"index": i * n + j, "text": choice_text, "logprobs": logprobs,
                                "finish_reason": sample.finish_reason, "stop_reason": sample.stop_reason})
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        return {"id": request_id, "object": "text_completion", "created": now(), "model": model, "choices": choices,
                "usage": usage(prompt_tokens, completion_tokens, cached)}

    async def _completion_stream(self, request, model, request_id, prompts, ids_only, params_list):
        created = now()
        n = request.n
        completion_tokens = 0
        try:
            if request.echo:
                for i, (text, ids) in enumerate(prompts):
                    for j in range(n):
                        echo = text if text is not None else self.tokenizer.decode(ids)
                        yield sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                                   "choices": [{"index": i * n + j, "text": echo, "logprobs": None, "finish_reason": None}]})
            cached = {}
            async for i, out in self.run_all(ids_only, params_list, request_id, request.priority, request.cache_salt,
                                             model=model):
                cached[i] = out.num_cached_tokens
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    if not c.text and c.finish_reason is None:
                        continue
                    logprobs = None
                    if request.logprobs is not None:
                        logprobs = self._completion_logprobs(c.token_ids, c.logprobs or [], request.logprobs)
                    yield sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                               "choices": [{"index": i * n + c.index, "text": c.text, "logprobs": logprobs,
                                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]})
            if request.stream_options and request.stream_options.include_usage:
                prompt_tokens = sum(len(ids) for ids in ids_only)
                yield sse({"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": [],
                           "usage": usage(prompt_tokens, completion_tokens, sum(cached.values()))})
        except OpenAIError as e:
            yield sse(e.body())
        yield sse("[DONE]")

    def _completion_logprobs(self, token_ids: list[int], positions: list[PositionLogprobs | None], k: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = 0
        for tid, pos in zip(token_ids, positions):
            piece = self.tokenizer.decode([tid], skip_special_tokens=False)
            tokens.append(piece)
            offsets.append(offset)
            offset += len(piece)
            if pos is None:
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(pos[tid].logprob if tid in pos else None)
            top: dict[str, float] = {}
            for _, lp in top_k(pos, k):
                top.setdefault(lp.decoded_token, lp.logprob)  # alternatives that decode alike: keep the likeliest
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

def _decoded(tokenizer, ids) -> str:
    """A token-id prompt as text, for the content filter ("" for ids the tokenizer cannot decode:
    the engine refuses those)."""
    try:
        return tokenizer.decode(list(ids))
    except Exception:  # noqa: BLE001 - out-of-range ids: answered by the engine's own check
        return ""


def _merge(a: dict, b: dict) -> dict:
    shift = (a["text_offset"][-1] + len(a["tokens"][-1])) if a["tokens"] else 0
    return {"tokens": a["tokens"] + b["tokens"], "token_logprobs": a["token_logprobs"] + b["token_logprobs"],
            "top_logprobs": a["top_logprobs"] + b["top_logprobs"],
            "text_offset": a["text_offset"] + [o + shift for o in b["text_offset"]]}
