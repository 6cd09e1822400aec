"""The input path shared by LLMEngine and AsyncLLM: a prompt and its sampling parameters become
the core's requests (tokenized, `n > 1` fanned out into n core requests, checked against the
core's limits) before anything is queued."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagoda.engine.content_filter import ContentFilterError
from pagoda.lora.checks import AdapterChecks
from pagoda.lora.request import LoRARequest
from pagoda.multimodal.inputs import PromptIds, images_of
from pagoda.multimodal.processor import ImagePrompts, multimodal_prompt
from pagoda.pooling_params import PoolingParams
from pagoda.request import EngineCoreRequest
from pagoda.sampling_params import SamplingParams
from pagoda.structured_output.grammar import validate_structured_outputs
from pagoda.tokenizer import Tokenizer

if TYPE_CHECKING:
    from pagoda.engine.content_filter import Moderation
    from pagoda.engine.core import RequestLimits

PromptType = str | dict[str, Any]


@dataclass
class PreparedRequest:
    """A request ready for the core (its n core requests) and for the output processor."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[tuple[str, SamplingParams]]
    core_requests: list[EngineCoreRequest]
    arrival_time: float

    def output_args(self) -> tuple:
        return self.request_id, self.prompt, self.prompt_token_ids, self.samples, self.arrival_time


class InputProcessor:
    """Thread-safe once `limits` is set (it reads only immutable state), so the server runs it
    on the HTTP side while the core steps elsewhere."""

    def __init__(self, tokenizer: Tokenizer, adapters: AdapterChecks | None = None,
                 images: ImagePrompts | None = None) -> None:
        self.tokenizer = tokenizer
        self.images = images  # a vision-language model's image path (None: a text model)
        self.adapters = adapters or AdapterChecks(None, {})  # a request's LoRA adapter, checked
        self.eos_token_ids = set(tokenizer.eos_token_ids)
        self.limits: RequestLimits | None = None  # the core's, set once its client is up

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "multi_modal_data" in prompt:
                return multimodal_prompt(self.images, prompt)
            if isinstance(prompt.get("prompt_token_ids"), PromptIds):  # a server's, images processed
                return prompt.get("prompt"), prompt["prompt_token_ids"]
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise ValueError("prompt_token_ids must be a list of integers")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise ValueError("a prompt must be a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}")

    def prepare_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                        priority: int = 0, arrival_time: float | None = None,
                        cache_salt: str | None = None, session_id: str | None = None,
                        lora_request: LoRARequest | None = None) -> PreparedRequest:
        """Tokenize, fan n > 1 out, build and validate the core requests; queue nothing."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        validate_structured_outputs(params.structured_outputs)
        lora_request = self.adapters.check(lora_request)
        text, prompt_ids = self.tokenize_prompt(prompt)
        if self.images is not None and not images_of(prompt_ids):
            self.images.check_no_image_tokens(prompt_ids)
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
            cache_salt = str(prompt["cache_salt"])  # vLLM's way: the salt rides with the prompt
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        samples = fan_out(request_id, params)
        requests = []
        for core_id, child in samples:
            child.all_stop_token_ids = set(self.eos_token_ids)
            requests.append(EngineCoreRequest(core_id, prompt_ids, child, priority=priority, arrival_time=arrival_time,
                                              cache_salt=cache_salt, session_id=session_id,
                                              lora_request=lora_request, images=images_of(prompt_ids)))
        self.limits.validate(requests[0])  # the children share the prompt
        return PreparedRequest(request_id, text, prompt_ids, samples, requests, arrival_time)

    def prepare_pooling_request(self, request_id: str, prompt: PromptType, params: PoolingParams, priority: int = 0,
                                arrival_time: float | None = None) -> PreparedRequest:
        """A pooling request (the pooling runner's): tokenized and checked, one core request."""
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams, got {type(params).__name__}")
        text, prompt_ids = self.tokenize_prompt(prompt)
        cut = params.truncate_prompt_tokens
        if cut is not None:  # the text cut to fit (-1: the model's whole context), its special tokens kept
            limit = self.limits.max_model_len if cut == -1 else min(cut, self.limits.max_model_len)
            if len(prompt_ids) > limit:  # (token ids given: the first ones)
                prompt_ids = self.tokenizer.encode_truncated(text, limit) if text is not None else prompt_ids[:limit]
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        request = EngineCoreRequest(request_id, prompt_ids, None, priority=priority, arrival_time=arrival_time,
                                    pooling_params=params)
        self.limits.validate(request)
        return PreparedRequest(request_id, text, prompt_ids, [], [request], arrival_time)

    def check_prompt(self, prepared: PreparedRequest, moderation: Moderation) -> None:
        """Raise ContentFilterError (a ValueError) if the prompt holds one of `moderation`'s terms."""
        text = prepared.prompt if prepared.prompt is not None else self.tokenizer.decode(prepared.prompt_token_ids)
        name = moderation.check_input(text)
        if name is not None:
            raise ContentFilterError(name)


def fan_out(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """n > 1 runs as n core requests; child i of a seeded request uses seed + i."""
    if params.n == 1:
        return [(request_id, params)]
    children = []
    for i in range(params.n):
        seed = None if params.seed is None else params.seed + i
        children.append((f"{i}_{request_id}", params.clone(n=1, seed=seed)))
    return children
