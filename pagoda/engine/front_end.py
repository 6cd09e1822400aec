"""What LLMEngine and AsyncLLM share, as siblings over a core client (vLLM v1's shape).

Both take a request through one input path (InputProcessor: tokenize, fan `n > 1` out, check
the limits) and its outputs through one output path (OutputProcessor: detokenize, stop strings,
logprobs, fan-in), and talk to the EngineCore through a client with one interface
(core_client.py): in the caller's thread for LLMEngine's loop, on a thread or in a process of
its own for AsyncLLM. A stop string is text, so only the output path sees it: `take_outputs`
finishes in the core whatever sample one ended, for both.
"""

from __future__ import annotations

from typing import Any

from pagoda.config import EngineConfig
from pagoda.engine.core import EngineCoreOutput, RequestLimits
from pagoda.engine.input_processor import InputProcessor, PreparedRequest
from pagoda.lora.checks import AdapterChecks
from pagoda.multimodal.processor import image_prompts
from pagoda.engine.output_processor import OutputProcessor
from pagoda.generation_defaults import sampling_defaults
from pagoda.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from pagoda.pooling_params import PoolingParams
from pagoda.request import RequestStatus
from pagoda.tokenizer import Tokenizer


class FrontEnd:
    client: Any  # a core client (core_client.py), set by the subclass once the core is up

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = Tokenizer(config.model.files.metadata_dir, chat_template=config.model.chat_template)
        images = image_prompts(config.model.hf_config, config.model.files.metadata_dir, self.tokenizer, config.images,
                               config.scheduler.max_num_batched_tokens)
        self.input_processor = InputProcessor(self.tokenizer, AdapterChecks(config.lora, config.model.hf_config,
                                                                            config.model.files.adapter), images)
        self.output_processor = OutputProcessor(self.tokenizer)
        # The model's own defaults for what a request leaves unset (generation_defaults.py)
        self.sampling_defaults = sampling_defaults(config.model.generation_config, config.model.files.metadata_dir)
        # the pooling runner's requests in flight (request id → prompt token ids): their one
        # output, the vector, needs no detokenizing, so they pass the output processor by
        self.pooling_requests: dict[str, list[int]] = {}

    @property
    def runner(self) -> str:
        """"generate" or "pooling" (--runner): what this model serves; the other kind is refused."""
        return self.config.model.runner

    def check_runner(self, wanted: str) -> None:
        """A ValueError saying why a request of the other runner's kind cannot run here."""
        if wanted == self.runner:
            return
        if wanted == "pooling":
            raise ValueError(f"this model ({self.config.model.name}) generates text: it serves no embeddings or "
                             "scores; serve an embedding model, or this one with --runner pooling")
        raise ValueError(f"this model ({self.config.model.name}) is an embedding model (--runner pooling): it "
                         "generates no text; use /v1/embeddings, /v1/score, /v1/rerank or /api/embed")

    def prepare_pooling(self, request_id: str, prompt, params: PoolingParams, priority: int = 0):
        """A pooling request checked against this model (its runner, ``dimensions``), tokenized."""
        self.check_runner("pooling")
        if self.config.model.cross_encoder and params.task != "score":
            raise ValueError(f"this model ({self.config.model.name}) is a cross-encoder: it scores text pairs "
                             "(LLM.score, /v1/score, /v1/rerank) and gives no embeddings")
        params.check_against(self.config.model.pooler, int(self.config.model.hf_config.get("hidden_size", 0)))
        return self.input_processor.prepare_pooling_request(request_id, prompt, params, priority)

    def submit_pooling(self, prepared: PreparedRequest) -> None:
        if prepared.request_id in self.pooling_requests or prepared.request_id in self.output_processor.requests:
            raise ValueError(f"request id {prepared.request_id!r} is already in use")
        self.pooling_requests[prepared.request_id] = prepared.prompt_token_ids
        self.client.add(prepared.core_requests)

    def _connect(self, client: Any) -> None:
        self.client = client
        self.input_processor.limits = client.limits

    @property
    def limits(self) -> RequestLimits:
        return self.client.limits

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    def submit(self, prepared: PreparedRequest, moderation: Any = None) -> None:
        """Queue a prepared request: its output state first, so no output can come before it.
        `moderation` (engine/content_filter.py's Moderation) filters its output text."""
        if prepared.request_id in self.output_processor.requests:
            raise ValueError(f"request id {prepared.request_id!r} is already in use")
        self.output_processor.add_request(*prepared.output_args(), moderation=moderation)
        self.client.add(prepared.core_requests)

    def take_outputs(self, core_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        """The step's RequestOutputs; the samples whose stop string the text hit are finished in
        the core (which sees tokens, not text)."""
        pooled: list = []
        if self.pooling_requests:
            pooled = [self._pooling_output(out) for out in core_outputs
                      if out.finished and out.request_id in self.pooling_requests]
            core_outputs = [out for out in core_outputs if out.request_id not in self.pooling_requests]
        outputs, to_stop = self.output_processor.process_outputs(core_outputs)
        if to_stop:
            self.client.finish(to_stop, RequestStatus.FINISHED_STOPPED)
        return pooled + outputs if pooled else outputs

    def _pooling_output(self, out: EngineCoreOutput) -> PoolingRequestOutput:
        ids = self.pooling_requests.pop(out.request_id)
        return PoolingRequestOutput(out.request_id, PoolingOutput(out.pooled) if out.pooled is not None else None, ids)

    def abort(self, request_id: str) -> None:
        """Forget a request and free its KV blocks in the core (its samples, if n > 1)."""
        if self.pooling_requests.pop(request_id, None) is not None:
            self.client.finish([request_id], RequestStatus.FINISHED_ABORTED)
            return
        core_ids = self.output_processor.core_ids(request_id)
        self.output_processor.abort_request(request_id)
        if core_ids:
            self.client.finish(core_ids, RequestStatus.FINISHED_ABORTED)
