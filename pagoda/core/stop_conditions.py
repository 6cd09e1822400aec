"""When a request stops, token by token: end of sequence, a stop token, max_tokens, the context,
or a grammar that is complete (or broken). The verdicts are pure; the scheduler, the only writer
of a `Request`, applies them. Stop *strings* are text: the front end's output path finds those
(engine/output_processor.py) and the engine core finishes the request through the scheduler."""

from __future__ import annotations

import logging

from pagoda.request import Request, RequestStatus

logger = logging.getLogger(__name__)

# (the status to finish with, the stop reason to report: a stop token's id, or None)
Verdict = tuple[RequestStatus, int | None]


def stop_verdict(request: Request, token: int, max_model_len: int) -> Verdict | None:
    """Whether ``token``, just appended, ends ``request``."""
    params = request.sampling_params
    num_output = len(request.output_token_ids)
    if num_output >= params.min_tokens:
        if not params.ignore_eos and token in params.all_stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if params.stop_token_ids and token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token
    if params.max_tokens is not None and num_output >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH, None
    if len(request.all_token_ids) >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None


def grammar_verdict(request: Request, token: int) -> Verdict | None:
    """Advance a constrained request's matcher; it stops when its grammar is complete."""
    if not request.grammar.accept(token):
        logger.warning("request %s: token %d breaks its grammar; stopping it", request.request_id, token)
        return RequestStatus.FINISHED_STOPPED, None
    if request.grammar.is_terminated():
        return RequestStatus.FINISHED_STOPPED, None
    return None
