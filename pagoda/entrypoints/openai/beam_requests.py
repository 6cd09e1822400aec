"""`use_beam_search` on /v1/completions and /v1/chat/completions, as vLLM takes it: a request's
fields → BeamSearchParams, and the 400s for what beam search does not do.

The beam width is `best_of` when given, else `n`; the best `n` beams are the choices, best first.
Beam search ranks candidates by the model's own logprobs, so every field that would change them
or the way tokens are picked (temperature above 0, top_p, penalties, logit_bias, stop strings,
constraints) is refused by name rather than silently ignored (vLLM ignores most of them), and so
are the logprobs of each token (the beams' cumulative logprobs are not OpenAI's per-token ones).
"""

from __future__ import annotations

from pagoda.entrypoints.openai.errors import OpenAIError, bad_value
from pagoda.entrypoints.openai.protocol import (
    ChatCompletionRequest, SamplingFields, SessionCreateRequest, SessionMessageRequest,
)
from pagoda.sampling_params import MAX_BEAM_WIDTH, BeamSearchParams

# Fields beam search does not apply, each with the values that mean "not used".
_NOT_APPLIED = {
    "top_p": (None, 1.0), "top_k": (None, 0, -1), "min_p": (None, 0.0), "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,), "repetition_penalty": (None, 1.0), "min_tokens": (0,), "stop": (None, [], ""),
    "stop_token_ids": (None, []), "logit_bias": (None, {}), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,), "structured_outputs": (None,), "suffix": (None,),
    "top_logprobs": (None,),
}


def beam_width(request: SamplingFields) -> int:
    """The sequences one prompt runs: its beam width with use_beam_search, else 1 (what the
    server's admission counts a prompt as)."""
    if not request.use_beam_search:
        return 1
    return request.best_of if request.best_of is not None else request.n


def check_best_of(request: SamplingFields) -> None:
    """best_of without beam search: only as many as n (vLLM V1 samples no best_of)."""
    if not request.use_beam_search and request.best_of not in (None, request.n):
        raise OpenAIError(f"best_of is supported only with use_beam_search (best_of={request.best_of}, "
                          f"n={request.n})", param="best_of")


def beam_search_params(request: SamplingFields, max_tokens: int) -> BeamSearchParams:
    """The request's beam search, or a 400 that names the field it cannot take."""
    if isinstance(request, (SessionCreateRequest, SessionMessageRequest)):
        raise OpenAIError("use_beam_search is not supported in sessions (a turn keeps one answer)",
                          param="use_beam_search")
    width = beam_width(request)
    width_field = "best_of" if request.best_of is not None else "n"
    if not 1 <= width <= MAX_BEAM_WIDTH:
        raise OpenAIError(f"{width_field} (the beam width) must be in [1, {MAX_BEAM_WIDTH}] with use_beam_search, "
                          f"got {width}", param=width_field)
    if request.n > width:
        raise OpenAIError(f"n must be at most best_of (the beam width) with use_beam_search, got n={request.n}, "
                          f"best_of={width}", param="n")
    if request.temperature is not None and request.temperature > 0:
        raise OpenAIError(f"temperature must be 0 with use_beam_search (beams are chosen by logprob, not "
                          f"sampled), got {request.temperature}", param="temperature")
    for name, neutral in _NOT_APPLIED.items():
        if name in request.model_fields_set and getattr(request, name) not in neutral:
            raise OpenAIError(f"{name} is not supported with use_beam_search", param=name)
    logprobs = getattr(request, "logprobs", None)  # chat: a bool; completions: a count (0 asks for one)
    if logprobs is not None and logprobs is not False:
        raise OpenAIError("logprobs is not supported with use_beam_search", param="logprobs")
    if request.response_format is not None and request.response_format.type != "text":
        raise OpenAIError("response_format is not supported with use_beam_search", param="response_format")
    if isinstance(request, ChatCompletionRequest) and request.tool_choice not in (None, "none", "auto"):
        raise OpenAIError("tool_choice must be 'auto' or 'none' with use_beam_search (it cannot constrain beams)",
                          param="tool_choice")
    try:
        return BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=request.ignore_eos,
                                length_penalty=request.length_penalty,
                                include_stop_str_in_output=request.include_stop_str_in_output,
                                early_stopping=request.early_stopping, n=request.n,
                                skip_special_tokens=request.skip_special_tokens)
    except ValueError as e:
        raise bad_value(e) from None
