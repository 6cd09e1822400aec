"""A request's grammar state looks ahead over speculative drafts and rolls back: the drafts it
allows, and the mask at each position of a run, leave the matcher where it was."""

from __future__ import annotations


from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured_output import StructuredOutputManager, build_token_bitmask
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
