"""A request's grammar state looks ahead over speculative drafts and rolls back: the drafts it
allows, and the mask at each position of a run, leave the matcher where it was."""

from __future__ import annotations

import torch

from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured_output import StructuredOutputManager, apply_token_bitmask, build_token_bitmask
from pagoda.tokenizer import Tokenizer


def test_drafts_are_checked_and_masked_per_position_then_rolled_back(tiny_llama):
    tokenizer = Tokenizer(tiny_llama)
    manager = StructuredOutputManager(tiny_llama, tokenizer.vocab_size, tokenizer.eos_token_ids)
    state = manager.grammar_for(StructuredOutputsParams(regex="ab[0-9]+"))
    a, b, one, x = (tokenizer.token_to_id(t) for t in ("a", "b", "1", "x"))
    assert state.valid_prefix([a, b, one, x, one]) == 3  # "x" breaks it: the drafts after it are not checked
    assert state.valid_prefix([b]) == 0  # the matcher did not move: "b" cannot start
    bitmask, firsts = build_token_bitmask([state, state], tokenizer.vocab_size, [[a, b], []])
    assert firsts == [0, 3] and bitmask.shape[0] == 4

    def allowed(row: int) -> set[int]:
        bits = bitmask[row]
        return {t for t in range(tokenizer.vocab_size) if (int(bits[t // 32]) >> (t % 32)) & 1}

    assert a in allowed(0) and b not in allowed(0)  # position 0: "a" only
    assert b in allowed(1) and a not in allowed(1)  # after "a": "b"
    assert one in allowed(2) and x not in allowed(2)  # after "ab": digits
    assert allowed(3) == allowed(0)  # the second state's row: rolled back to the start
    assert state.accept(a) and not state.is_terminated()
    manager.shutdown()


def test_a_stop_token_ends_a_complete_grammar_also_among_drafts(tiny_llama):
    tokenizer = Tokenizer(tiny_llama)
    manager = StructuredOutputManager(tiny_llama, tokenizer.vocab_size, tokenizer.eos_token_ids)
    state = manager.grammar_for(StructuredOutputsParams(regex="ab1?"))
    a, b, one = (tokenizer.token_to_id(t) for t in ("a", "b", "1"))
    stop = tokenizer.eos_token_ids[0]
    assert state.valid_prefix([a, stop]) == 1  # "a" alone is not complete
    assert state.valid_prefix([a, b, stop, a]) == 3  # complete after "ab": the stop token ends it
    bitmask, _ = build_token_bitmask([state], tokenizer.vocab_size, [[a, b, stop]])
    assert bitmask.shape[0] == 4 and _allowed(bitmask[2], tokenizer.vocab_size) == {one, stop}
    assert state.accept(a) and state.accept(b) and state.accept(one)  # now it can only stop
    assert _allowed(build_token_bitmask([state], tokenizer.vocab_size)[0][0], tokenizer.vocab_size) == {stop}
    assert state.valid_prefix([stop]) == 1 and state.valid_prefix([a]) == 0
    build_token_bitmask([state], tokenizer.vocab_size, [[stop]])  # looks ahead over the stop token, rolls back
    assert not state.is_terminated() and state.accept(stop) and state.is_terminated()
    assert not state.accept(stop)  # nothing after the end
    manager.shutdown()


def _allowed(row: torch.Tensor, vocab_size: int) -> set[int]:
    return {t for t in range(vocab_size) if (int(row[t // 32]) >> (t % 32)) & 1}


def test_apply_token_bitmask_sets_disallowed_logits_of_the_given_rows_only():
    vocab = 70  # not a multiple of 32; the mask covers 64 tokens, the rest are never allowed
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 2), dtype=torch.int32, generator=generator)
    logits = torch.randn(3, vocab, generator=generator)
    masked = logits.clone()
    apply_token_bitmask(masked, bitmask, [0, 2])
    assert torch.equal(masked[1], logits[1])
    for row in (0, 2):
        allowed = _allowed(bitmask[row], 64)
        for t in range(vocab):
            assert masked[row, t] == (logits[row, t] if t in allowed else float("-inf")), (row, t)
