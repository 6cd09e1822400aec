"""What the engine returns, in vLLM's shapes (RequestOutput / CompletionOutput / Logprob), and the
worker's per-step output (ModelRunnerOutput) that the engine core turns into them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class TokenLogprobs:
    """Logprobs at one position as the model runner reports them: the chosen (or prompt) token
    first, then the top-k alternatives."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int  # rank of the chosen token (1 = most likely)


@dataclass
class ModelRunnerOutput:
    """What a worker returns for one step: plain data, picklable across processes."""

    # request id → its new tokens: one, or with speculative decoding the accepted drafts and the
    # target's own next token
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # one per token of sampled_token_ids
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)  # drafts to verify next step
    spec_draft_seconds: float = 0.0  # time spent proposing drafts this step
    spec_verify_seconds: float = 0.0  # the step's time, when it verified drafts
    # the pooling runner: request id → its pooled vector (float32, on the CPU), once its prompt ran
    pooler_output: dict[str, Any] = field(default_factory=dict)


# One position: token id → Logprob (the chosen token plus the top-k alternatives).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class PoolingOutput:
    """A pooling request's vector (float32 tensor, on the CPU), as vLLM's ``PoolingOutput.data``."""

    data: Any

    @property
    def embedding(self) -> list[float]:
        return self.data.tolist()


@dataclass
class ScoringOutput:
    """A pair's score: the cosine similarity of the two texts' vectors (vLLM's ``ScoringOutput``)."""

    score: float


@dataclass
class PoolingRequestOutput:
    """A pooling request's result (vLLM's shape: ``EmbeddingRequestOutput`` and
    ``ScoringRequestOutput`` are this with ``outputs.embedding`` / ``outputs.score``)."""

    request_id: str
    outputs: PoolingOutput | ScoringOutput | None  # None: it was aborted
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    extra: dict = field(default_factory=dict)
