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
from pagoda.engine.output_processor import OutputProcessor
from pagoda.generation_defaults import sampling_defaults
from pagoda.outputs import RequestOutput
from pagoda.request import RequestStatus
from pagoda.tokenizer import Tokenizer


class FrontEnd:
    client: Any  # a core client (core_client.py), set by the subclass once the core is up

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = Tokenizer(config.model.files.metadata_dir, chat_template=config.model.chat_template)
        self.input_processor = InputProcessor(self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        # The model's own defaults for what a request leaves unset (generation_defaults.py)
        self.sampling_defaults = sampling_defaults(config.model.generation_config, config.model.files.metadata_dir)

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
        outputs, to_stop = self.output_processor.process_outputs(core_outputs)
        if to_stop:
            self.client.finish(to_stop, RequestStatus.FINISHED_STOPPED)
        return outputs

    def abort(self, request_id: str) -> None:
        """Forget a request and free its KV blocks in the core (its samples, if n > 1)."""
        core_ids = self.output_processor.core_ids(request_id)
        self.output_processor.abort_request(request_id)
        if core_ids:
            self.client.finish(core_ids, RequestStatus.FINISHED_ABORTED)
