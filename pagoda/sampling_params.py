"""Sampling parameters of one request, validated on construction (errors name the field)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import IntEnum


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0  # every output carries all text so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # one output, when the request finishes


_GREEDY_EPS = 1e-5
INT64_MAX = 2**63 - 1  # integers that reach int64 tensors (top_k, token ids) must fit


@dataclass
class StructuredOutputsParams:
    """A constraint on the output, exactly one of:

    json: a JSON schema (dict or JSON text); json_object: any JSON object; regex: a regular
    expression; choice: one of these strings; grammar: a GBNF grammar (llama.cpp's EBNF, root
    rule `root`) or a Lark one (rule `start`). The engine compiles it with llguidance and masks
    every sampled token to it.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    whitespace_flexible: bool = False  # allow any JSON whitespace (off: compact JSON, as models write it)

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, json_object, regex, choice, grammar; "
                f"got {', '.join(given) if given else 'none'}"
            )
        if self.json is not None:
            _check(isinstance(self.json, (dict, str)), "structured_outputs.json", "must be a JSON schema (an object or JSON text)")
        if self.regex is not None:
            _check(isinstance(self.regex, str) and self.regex != "", "structured_outputs.regex", "must be a non-empty string")
        if self.choice is not None:
            _check(isinstance(self.choice, list) and len(self.choice) > 0
                   and all(isinstance(c, str) and c for c in self.choice),
                   "structured_outputs.choice", "must be a non-empty list of non-empty strings")
        if self.grammar is not None:
            _check(isinstance(self.grammar, str) and self.grammar.strip() != "", "structured_outputs.grammar", "must be a non-empty EBNF string")

    @property
    def kind(self) -> str:
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name


@dataclass
class SamplingParams:
    """What to generate and how, in vLLM's shape.

    temperature 0 means greedy. `seed` makes sampling reproducible per request, whatever the
    batch. `logprobs=k` returns the chosen token's logprob plus the top k; `prompt_logprobs=k`
    the same for every prompt token after the first.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # Speculative decoding, where the engine has it: False opts this request out (it decodes one
    # token a step, beside requests that speculate).
    speculative: bool = True
    # Filled by the engine: the tokens that end generation besides stop_token_ids (the model's eos).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    # -- validation -----------------------------------------------------------------------
    def validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        _check_number(self.temperature, "temperature", lo=0.0)
        _check_number(self.top_p, "top_p", lo=0.0, hi=1.0)
        _check(self.top_p > 0.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(isinstance(self.top_k, int) and -1 <= self.top_k <= INT64_MAX, "top_k",
               f"must be -1, 0 (off) or a positive integer (int64), got {self.top_k!r}")
        _check_number(self.min_p, "min_p", lo=0.0, hi=1.0)
        _check_number(self.presence_penalty, "presence_penalty", lo=-2.0, hi=2.0)
        _check_number(self.frequency_penalty, "frequency_penalty", lo=-2.0, hi=2.0)
        _check_number(self.repetition_penalty, "repetition_penalty")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.seed is not None:
            _check(isinstance(self.seed, int) and -(2**63) <= self.seed < 2**64, "seed",
                   f"must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if self.max_tokens is not None:
            _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        _check(isinstance(self.speculative, bool), "speculative", f"must be true or false, got {self.speculative!r}")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(all(isinstance(t, int) and 0 <= t <= INT64_MAX for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative integers (int64)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check(isinstance(value, int) and 0 <= value <= 20, name, f"must be an integer in [0, 20], got {value!r}")
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict), "logit_bias", "must map token ids to biases")
            for tok, bias in self.logit_bias.items():
                _check(isinstance(tok, int) and 0 <= tok <= INT64_MAX, "logit_bias", f"keys must be token ids, got {tok!r}")
                _check_number(bias, "logit_bias", lo=-100.0, hi=100.0)
        if self.structured_outputs is not None:
            _check(isinstance(self.structured_outputs, StructuredOutputsParams), "structured_outputs",
                   f"must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}")
        if self.top_k == -1:
            self.top_k = 0

    # -- derived properties ---------------------------------------------------------------
    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def clone(self, **changes) -> "SamplingParams":
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        fields.update(changes)
        new = SamplingParams(**{k: (list(v) if isinstance(v, list) else v) for k, v in fields.items()})
        new.all_stop_token_ids = set(self.all_stop_token_ids)
        return new


MAX_BEAM_WIDTH = 10  # each step asks for 2 x beam_width logprobs, and logprobs stop at 20


@dataclass
class BeamSearchParams:
    """A beam search's parameters, in vLLM's shape (`LLM.beam_search`, `use_beam_search`).

    Each step keeps the `beam_width` likeliest continuations (by cumulative logprob); a beam that
    samples an end-of-sequence token is finished, and the answer ranks finished and live beams by
    `cum_logprob / len ** length_penalty` (len counts the prompt, as vLLM's does). temperature
    must be 0: candidates come from the model's logprobs, not from sampling. pagoda's additions:
    `early_stopping` (stop once `beam_width` beams have finished and answer those, as
    transformers' `early_stopping=True`), `n` (return only the best n), `skip_special_tokens`
    (for the server's text).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool = False
    n: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        _check(isinstance(self.beam_width, int) and not isinstance(self.beam_width, bool)
               and 1 <= self.beam_width <= MAX_BEAM_WIDTH, "beam_width",
               f"must be an integer in [1, {MAX_BEAM_WIDTH}] (each step asks for 2 x beam_width logprobs, "
               f"at most 20), got {self.beam_width!r}")
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
               f"must be an integer >= 1, got {self.max_tokens!r}")
        _check_number(self.temperature, "temperature", lo=0.0)
        _check(self.temperature < _GREEDY_EPS, "temperature",
               f"must be 0 with beam search (beams are chosen by logprob, not sampled), got {self.temperature}")
        _check_number(self.length_penalty, "length_penalty")
        _check(abs(self.length_penalty) != float("inf"), "length_penalty", "must be finite")
        for name in ("ignore_eos", "include_stop_str_in_output", "early_stopping", "skip_special_tokens"):
            _check(isinstance(getattr(self, name), bool), name, f"must be true or false, got {getattr(self, name)!r}")
        if self.n is not None:
            _check(isinstance(self.n, int) and 1 <= self.n <= self.beam_width, "n",
                   f"must be an integer in [1, beam_width={self.beam_width}], got {self.n!r}")

    @property
    def structured_outputs(self) -> None:
        """Beam search takes no output constraint (the paths that read a request's constraint ask)."""
        return None


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")


def _check_number(value, name: str, lo: float | None = None, hi: float | None = None) -> None:
    _check(isinstance(value, (int, float)) and not isinstance(value, bool), name, f"must be a number, got {value!r}")
    if value != value:  # NaN
        raise ValueError(f"{name} must be a number, got NaN")
    if lo is not None:
        _check(value >= lo, name, f"must be >= {lo}, got {value}")
    if hi is not None:
        _check(value <= hi, name, f"must be <= {hi}, got {value}")
