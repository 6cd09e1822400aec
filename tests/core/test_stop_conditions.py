"""The stop verdicts (pagoda/core/stop_conditions.py): what ends a request, token by token."""

from __future__ import annotations

from pagoda.core.stop_conditions import stop_verdict
from pagoda.request import Request, RequestStatus
from pagoda.sampling_params import SamplingParams

EOS = 2


def _request(**params) -> Request:
    sp = SamplingParams(**params)
    sp.all_stop_token_ids = {EOS}
    return Request("r", [5, 6, 7], sp)


def _verdicts(request: Request, tokens: list[int], max_model_len: int = 100) -> list:
    out = []
    for token in tokens:
        request.append_output_token(token)
        out.append(stop_verdict(request, token, max_model_len))
    return out


def test_end_of_sequence_stops_unless_ignored_or_before_min_tokens():
    assert _verdicts(_request(max_tokens=10), [9, EOS]) == [None, (RequestStatus.FINISHED_STOPPED, None)]
    assert _verdicts(_request(max_tokens=10, ignore_eos=True), [9, EOS]) == [None, None]
    assert _verdicts(_request(max_tokens=10, min_tokens=3), [EOS, EOS, EOS]) == \
        [None, None, (RequestStatus.FINISHED_STOPPED, None)]


def test_a_stop_token_is_reported_as_the_reason():
    assert _verdicts(_request(max_tokens=10, stop_token_ids=[11]), [9, 11]) == \
        [None, (RequestStatus.FINISHED_STOPPED, 11)]


def test_max_tokens_and_the_context_end_a_request_by_length():
    assert _verdicts(_request(max_tokens=2), [9, 9]) == [None, (RequestStatus.FINISHED_LENGTH, None)]
    # 3 prompt tokens + 2 outputs reach a context of 5
    assert _verdicts(_request(max_tokens=10), [9, 9], max_model_len=5) == [None, (RequestStatus.FINISHED_LENGTH, None)]
