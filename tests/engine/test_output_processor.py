"""The output path (pagoda/engine/output_processor.py) fed core outputs by hand: stop strings
found across tokens and cut (or kept), a tail that may start a stop string held back in deltas,
n > 1 samples gathered into one output."""

from __future__ import annotations

import pytest

from pagoda.engine.core import EngineCoreOutput
from pagoda.engine.output_processor import OutputProcessor
from pagoda.sampling_params import RequestOutputKind, SamplingParams
from pagoda.tokenizer import Tokenizer

TEXT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama) -> Tokenizer:
    return Tokenizer(tiny_llama)


def _tokens(tokenizer: Tokenizer) -> list[int]:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert tokenizer.decode(ids) == TEXT
    return ids


def _run(tokenizer, params: SamplingParams, ids: list[int], core_id: str = "r"):
    """Feed ``ids`` one token a step; the outputs handed out and the step the core was told to stop."""
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [1, 2], [(core_id, params)], arrival_time=0.0)
    outputs, stopped_at = [], None
    for step, token in enumerate(ids):
        results, to_stop = processor.process_outputs([EngineCoreOutput(core_id, [token])])
        outputs += results
        if to_stop:
            assert to_stop == [core_id]
            stopped_at = step
            break
    return outputs, stopped_at, processor


@pytest.mark.parametrize("keep", [False, True])
def test_a_stop_string_across_tokens_ends_the_sample(tokenizer, keep):
    ids = _tokens(tokenizer)
    params = SamplingParams(stop=["on the"], include_stop_str_in_output=keep, output_kind=RequestOutputKind.FINAL_ONLY)
    outputs, stopped_at, processor = _run(tokenizer, params, ids)
    assert stopped_at is not None and stopped_at < len(ids) - 1  # the core is told before the text runs out
    (final,) = outputs
    choice = final.outputs[0]
    assert final.finished and (choice.finish_reason, choice.stop_reason) == ("stop", "on the")
    assert choice.text == ("the cat sat on the" if keep else "the cat sat ")
    assert not processor.has_unfinished_requests()


def test_deltas_hold_back_what_could_start_a_stop_string(tokenizer):
    ids = _tokens(tokenizer)
    params = SamplingParams(stop=["mat!"], output_kind=RequestOutputKind.DELTA)
    outputs, stopped_at, processor = _run(tokenizer, params, ids)
    assert stopped_at is None
    handed = "".join(o.outputs[0].text for o in outputs if o.outputs)
    assert TEXT.startswith(handed) and len(TEXT) - len(handed) <= len("mat!") - 1  # a tail held back
    results, _ = processor.process_outputs([EngineCoreOutput("r", [], finish_reason="length")])
    assert handed + results[0].outputs[0].text == TEXT and results[0].finished  # released at the end


def test_samples_of_one_request_are_gathered(tokenizer):
    ids = _tokens(tokenizer)
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(n=2, output_kind=RequestOutputKind.FINAL_ONLY)
    processor.add_request("r", None, [1, 2], [("0_r", params), ("1_r", params)], arrival_time=0.0)
    first, _ = processor.process_outputs([EngineCoreOutput("0_r", ids[:2], finish_reason="length")])
    assert first == []  # one sample of two done: nothing yet
    (out,), _ = processor.process_outputs([EngineCoreOutput("1_r", ids[:3], finish_reason="length")])
    assert [c.index for c in out.outputs] == [0, 1] and [len(c.token_ids) for c in out.outputs] == [2, 3]


@pytest.mark.parametrize("keep", [False, True])
def test_a_stop_tokens_text_is_not_output_unless_asked_for(tokenizer, keep):
    """The core stopped on a stop token (end of sequence, or one of stop_token_ids): its text is
    not in the output, even where special tokens are kept, unless include_stop_str_in_output."""
    ids = _tokens(tokenizer)
    eos = tokenizer.eos_token_id
    for stop_token, stop_reason, params in [
        (eos, None, SamplingParams(skip_special_tokens=False, include_stop_str_in_output=keep)),
        (ids[-1], ids[-1], SamplingParams(stop_token_ids=[ids[-1]], include_stop_str_in_output=keep)),
    ]:
        params.output_kind, params.all_stop_token_ids = RequestOutputKind.FINAL_ONLY, {eos}
        processor = OutputProcessor(tokenizer)
        processor.add_request("r", None, [1, 2], [("r", params)], arrival_time=0.0)
        body = ids[:-1] if stop_token == ids[-1] else ids
        processor.process_outputs([EngineCoreOutput("r", body)])
        (out,), _ = processor.process_outputs([EngineCoreOutput("r", [stop_token], finish_reason="stop",
                                                                stop_reason=stop_reason)])
        choice = out.outputs[0]
        stop_text = tokenizer.decode([stop_token], skip_special_tokens=False)
        assert choice.token_ids[-1] == stop_token
        assert choice.text == tokenizer.decode(body) + (stop_text if keep else "")
