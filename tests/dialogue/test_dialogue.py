"""pagoda.dialogue: the topic stack, slots, the policy (no model); pagoda.lang programs on a
session (the tiny model); and the restaurant-booking example's scripted 12-turn conversation
on the real SmolLM2, against a naive replay of the same conversation."""

from __future__ import annotations

import sys
from pathlib import Path

import jsonschema
import pytest

from pagoda import lang
from pagoda.dialogue import (
    Dialogue, DialogueState, Slot, StateTable, Topic, TopicStack, Understanding, answer, ask, complete, say,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import restaurant_booking as app

# -- the dialogue layer, no model -----------------------------------------------------------------


def test_topic_stack_push_pop_and_resume_keep_the_interrupted_slots():
    booking, menu, weather = Topic("booking", slots=app.SLOTS), Topic("menu"), Topic("weather")
    stack = TopicStack()
    assert stack.current is None
    frame = stack.push(booking)
    frame.fill("party_size", 4)
    stack.push(menu)
    assert frame.status == "interrupted" and stack.current.name == "menu" and stack.names() == ["booking", "menu"]
    done = stack.pop()
    assert done.status == "done" and stack.current is frame and frame.status == "active"
    assert frame.values == {"party_size": 4}
    # resume(name) goes back down to an interrupted topic, abandoning what is above it
    stack.push(menu)
    stack.push(weather)
    assert stack.resume("booking") is frame and stack.names() == ["booking"]
    assert [f.status for f in stack.closed] == ["done", "abandoned", "abandoned"]
    assert stack.events == [("push", "booking"), ("interrupt", "booking"), ("push", "menu"), ("pop", "menu"),
                            ("resume", "booking"), ("interrupt", "booking"), ("push", "menu"),
                            ("interrupt", "menu"), ("push", "weather"), ("abandon", "weather"), ("resume", "menu"),
                            ("abandon", "menu"), ("resume", "booking")]
    with pytest.raises(KeyError):
        stack.resume("dessert")
    stack.pop()
    with pytest.raises(IndexError):
        stack.pop()


def test_slots_are_typed_by_json_schema_and_grounded_in_the_message():
    party, day, time_, name = app.SLOTS
    assert [(c.span, c.value) for c in party.candidates("Four of us at 19:30, maybe 5, not 30 or table 99")] == \
        [("Four", 4), ("5", 5)]  # 19 and 30 are a time's; 30 and 99 are out of range (1-20)
    assert [(c.span, c.value) for c in day.candidates("friday or Sunday? not funday")] == \
        [("friday", "friday"), ("Sunday", "sunday")]
    assert [c.value for c in time_.candidates("at 19:30 or 25:00 or 7:15")] == ["19:30"]
    assert [c.value for c in name.candidates("My name is Maria.")] == ["My", "Maria"]
    assert party.candidates("Hello!") == []
    for slot, good, bad in [(party, 20, 21), (party, 1, 0), (day, "monday", "Monday"), (time_, "23:59", "24:00"),
                            (name, "Li", "L")]:
        assert slot.is_valid(good) and not slot.is_valid(bad)
        with pytest.raises(jsonschema.ValidationError):
            slot.validate(bad)
    frame = TopicStack().push(Topic("booking", slots=app.SLOTS))
    with pytest.raises(jsonschema.ValidationError):
        frame.fill("time", "7pm")
    assert frame.values == {} and [s.name for s in frame.missing()] == ["party_size", "day", "time", "name"]
    # A bad schema or an example answer that is not a span of its message is refused up front.
    with pytest.raises(jsonschema.SchemaError):
        Slot("n", {"type": "integer", "minimum": "one"}, "How many?")
    with pytest.raises(ValueError, match="not a candidate"):
        Slot("n", {"type": "integer"}, "How many?", examples=[("for four", "five")])
    prompt = party.query("We are three.")
    assert prompt.startswith(party.instruction) and prompt.endswith("Message: We are three.\nParty size:")
    assert "Message: Is table 7 free?\nParty size: none\n" in prompt


def test_state_table_matches_topic_and_condition_in_order():
    table = StateTable({
        ("booking", "missing"): ask(),
        ("booking", ("ok", "filled")): complete("Booked."),
        ("booking", "always"): say("Shall I book it?", name="confirm"),
        ("*", "hello"): say("Hi!", name="greet"),
        (None, lambda state, nlu: nlu.message.endswith("?")): answer(),
        (None, "vip"): lambda state, nlu: say(f"Welcome back, turn {state.turn}!", name="vip"),
    }, conditions={"vip": lambda state, nlu: nlu.intent == "vip"})
    stack = TopicStack()
    state = DialogueState(stack, turn=3)
    assert table(state, Understanding("hello")).name == "greet"
    assert table(state, Understanding("other", message="Open today?")).name == "answer"
    assert table(state, Understanding("vip")).say == "Welcome back, turn 3!"
    assert table(state, Understanding("nonsense")).name == "fallback"
    frame = stack.push(Topic("booking", slots=app.SLOTS[:1]))
    assert table(state, Understanding("ok")).name == "ask"  # "missing" comes first
    assert table(state, Understanding("hello")).name == "ask"
    frame.fill("party_size", 2)
    assert table(state, Understanding("ok")).name == "complete"
    assert table(state, Understanding("hello")).name == "confirm"


def _offline(policy) -> Dialogue:
    return Dialogue(None, topics=app.TOPICS, intents=app.INTENTS, policy=policy)


def _replies(dialogue: Dialogue, nlus: list[Understanding]) -> tuple[list[str], DialogueState]:
    state = DialogueState(TopicStack())
    replies = []
    for i, nlu in enumerate(nlus, 1):
        state.turn = i
        steps = dialogue.decide(state, nlu)
        replies.append(" ".join(filter(None, (" ".join(p for p in (b, "<gen>" if g else "", a) if p)
                                              for b, g, a in (dialogue.render(*step) for step in steps)))))
    return replies, state


# The example's script as NLU results: what the DM does with them does not need a model.
SCRIPTED_NLU = [
    Understanding("hello"), Understanding("booking", {"party_size": 4}), Understanding("booking", {"day": "friday"}),
    Understanding("other"), Understanding("other"), Understanding("booking", {"time": "19:30"}),
    Understanding("booking", {"name": "Maria"}), Understanding("booking", {"party_size": 5}), Understanding("ok"),
    Understanding("other"), Understanding("other"), Understanding("bye"),
]


def test_the_dm_handles_a_digression_and_returns_to_the_booking():
    replies, state = _replies(_offline(app.POLICY), SCRIPTED_NLU)
    assert replies[1] == "Which day would you like to come?"
    assert replies[3] == "<gen> Shall we go on with your booking?"  # the booking waits below the question
    assert replies[5] == "Now, back to your booking. What name should I put the booking under?"
    assert replies[6] == "So that is a table for 4 on friday at 19:30, under the name Maria. Shall I book it?"
    assert replies[8].startswith("Done! Your table for 5 on friday at 19:30 is booked under the name Maria.")
    assert replies[9] == "<gen> Anything else?"
    assert replies[11] == "Thank you, goodbye!"
    assert state.stack.names() == [] and [f.name for f in state.stack.closed] == ["question", "booking", "question"]
    assert state.stack.closed[1].values == {"party_size": 5, "day": "friday", "time": "19:30", "name": "Maria"}


def test_completing_a_topic_resumes_the_interrupted_one_in_the_same_reply():
    """A digression that ends itself (complete) hands the reply back to the topic below it."""
    topics = [Topic("booking", intents=["booking"], slots=app.SLOTS, resume_text="Back to the booking."),
              Topic("faq", intents=["other"])]
    policy = StateTable({("booking", "missing"): ask(), ("faq", "always"): complete("We open at noon.")})
    dialogue = Dialogue(None, topics=topics, intents=app.INTENTS, policy=policy)
    replies, state = _replies(dialogue, [Understanding("booking", {"party_size": 2}), Understanding("other")])
    assert replies[1] == "We open at noon. Back to the booking. Which day would you like to come?"
    assert state.stack.names() == ["booking"] and state.stack.current.values == {"party_size": 2}


def test_a_policy_written_as_code_does_what_the_table_does():
    def policy(state, nlu):
        frame = state.current
        if nlu.intent == "bye":
            return say("Thank you, goodbye!", name="bye")
        if frame is not None and frame.name == "booking":
            if frame.missing():
                return ask()
            if nlu.intent == "ok":
                return app.POLICY.table[2][1]  # the same "book" action
            return say("So that is a table for {party_size} on {day} at {time}, under the name {name}. "
                       "Shall I book it?", name="confirm")
        if frame is not None and frame.name == "question":
            return app._answer_question(state, nlu)
        if nlu.intent == "hello":
            return say("Hello! Welcome to Trattoria Pagoda. I can book you a table or answer your questions.",
                       name="greet")
        return say("I can book you a table or answer questions about the restaurant.", name="help")

    assert _replies(_offline(policy), SCRIPTED_NLU)[0] == _replies(_offline(app.POLICY), SCRIPTED_NLU)[0]


# -- pagoda.lang on a session (the tiny model) ----------------------------------------------------


def test_a_program_run_on_a_session_pins_its_prefix_and_fork_branches_do_not(tiny_llama):
    from pagoda import LLM

    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory=0.02)
    engine = lang.Engine(llm=llm)
    stats = llm.engine.stats

    prefix = "A conversation that is long enough to fill several KV blocks of sixteen tokens each. " * 3

    @lang.function
    def first(s):
        s += prefix
        s += lang.gen("a", max_tokens=4)

    state = first.run(backend=engine, session_id="chat-1")
    assert state.session_id == "chat-1" and stats()["num_sessions_pinned"] == 1
    pinned = stats()["session_pinned_blocks"]
    prefix_blocks = len(llm.engine.tokenizer.encode(prefix)) // 16
    assert pinned >= prefix_blocks > 0
    # The next turn: a state on the same text and session reads the pinned prefix from the cache.
    turn = lang.ProgramState(engine, state.text(), session_id="chat-1")
    turn += " And then?"
    turn += lang.gen("b", max_tokens=4)
    assert turn.meta("b").cached_tokens >= prefix_blocks * 16
    # A fork prefills its prefix on the session (the pin moves there); its branches run without
    # the session, so their own tails do not move it again.
    branches = turn.fork(2)
    at_fork = stats()["session_pinned_blocks"]
    assert stats()["num_sessions_pinned"] == 1 and at_fork >= pinned
    for i, branch in enumerate(branches):
        assert branch.session_id is None
        branch += f" Branch {i} says something long enough to complete another block of the cache"
        branch += lang.gen("c", max_tokens=4)
    branches.join()
    assert stats()["num_sessions_pinned"] == 1 and stats()["session_pinned_blocks"] == at_fork
    engine.release_session("chat-1")
    assert stats()["num_sessions_pinned"] == 0
    llm.shutdown()


def test_a_dialogue_runs_on_a_server_through_the_endpoint(long_tiny_llama):
    """The same turn program over HTTP (`lang.Endpoint`, session ids as X-Session-ID headers);
    the tiny model's answers are noise, but every turn completes on the constrained choices and
    its token counts come back from the server's usage."""
    from server_process import start_server

    proc, base = start_server(long_tiny_llama, "--max-model-len", "2048")  # few-shot NLU prompts: past 256 tokens
    try:
        dialogue = app.build(lang.Endpoint(base), reply_tokens=8)
        dialogue.prepare()
        session = dialogue.session()
        turns = [session.say(message) for message in app.SCRIPT[:3]]
        for turn in turns:
            assert turn.intent in app.INTENTS and turn.reply and turn.prompt_tokens > 0
            assert turn.tokens("transcript", "prompt_tokens") == turn.transcript_tokens > 0
        assert turns[-1].tokens("transcript", "cached_tokens") > 0  # the server's prefix cache
        session.close()  # an Endpoint has no release_session: nothing to let go
        dialogue.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# -- the example on SmolLM2 -----------------------------------------------------------------------

EXPECTED_BOOKING = {"party_size": 5, "day": "friday", "time": "19:30", "name": "Maria"}


@pytest.mark.slow
def test_the_scripted_conversation_on_smollm2_fills_the_slots_unwinds_the_stack_and_stays_flat(smollm2_gguf):
    engine = app.engine(str(smollm2_gguf), kv_cache_memory=0.3)
    dialogue = app.build(engine, reply_tokens=24)
    dialogue.prepare()
    session = dialogue.session()
    texts, values = [], []
    try:
        for message in app.SCRIPT:
            turn = session.say(message)
            texts.append(session.text())
            values.append(dict(session.stack.current.values) if session.stack.current is not None else None)
            print(f"[{turn.index}] {message!r} -> {turn.reply!r} ({turn.intent}, {turn.action}, {turn.stack}, "
                  f"{turn.slots}; computed {turn.tokens('transcript')} + {turn.tokens('nlu')} of "
                  f"{turn.prompt_tokens}, history {turn.transcript_tokens}, {turn.latency_s:.2f} s)")
    finally:
        session.close()
        dialogue.close()
    turns = session.turns
    assert engine.llm.engine.stats()["num_sessions_pinned"] == 0  # the session and the NLU prompts let go

    # Slots: filled from the user's messages, valid under their schemas, the change of party size taken.
    booking = [f for f in session.stack.closed if f.name == "booking"]
    assert len(booking) == 1 and booking[0].status == "done" and booking[0].values == EXPECTED_BOOKING
    for slot in app.SLOTS:
        slot.validate(booking[0].values[slot.name])
    assert [t.intent for t in turns] == ["hello", "booking", "booking", "other", "other", "booking", "booking",
                                         "booking", "ok", "other", "other", "bye"]
    # The topic stack: the digression is pushed over the booking, popped, and the booking resumes
    # with its slots intact; the booking completes; the stack unwinds to empty.
    assert [t.stack for t in turns] == [[], ["booking"], ["booking"], ["booking", "question"],
                                        ["booking", "question"], ["booking"], ["booking"], ["booking"], [],
                                        ["question"], ["question"], []]
    assert turns[3].events == [("interrupt", "booking"), ("push", "question")]
    assert values[4] == {} and turns[5].events == [("pop", "question"), ("resume", "booking")]
    assert values[5] == {"party_size": 4, "day": "friday", "time": "19:30"}
    assert turns[5].reply.startswith("Now, back to your booking.")
    assert turns[8].events == [("pop", "booking")] and turns[8].reply.startswith("Done!")
    assert turns[11].reply == "Thank you, goodbye!"

    # Per-turn computed prompt tokens stay flat: a turn computes its own new text (the last reply,
    # the user's message, the turn markers) and less than a KV block more per request, not the history.
    tok = engine.llm.engine.tokenizer
    new_text = max(len(tok.encode(t.user)) + len(tok.encode(t.reply)) for t in turns)
    for t in turns[5:]:
        assert t.tokens("transcript") <= new_text + 16 + 16, t
        assert t.cached_tokens >= 0.75 * t.prompt_tokens, t
    late, early = max(t.computed_tokens for t in turns[5:]), max(t.computed_tokens for t in turns[:5])
    assert late <= 1.25 * early
    assert turns[-1].tokens("transcript") < 0.2 * turns[-1].transcript_tokens

    # The naive replay: the same conversation, the whole history in every prompt, no prefix cache.
    naive = app.engine(str(smollm2_gguf), naive=True, kv_cache_memory=0.3)
    computed = []
    for text in texts:
        out = naive.prefill(text)
        assert out.cached_tokens == 0
        computed.append(out.prompt_tokens)
    naive.llm.shutdown()
    engine.llm.shutdown()
    print("naive computed per turn:", computed)
    assert computed == sorted(computed) and computed[-1] > 3 * computed[1]
    assert sum(t.tokens("transcript") for t in turns) < 0.3 * sum(computed)
    assert max(t.tokens("transcript") for t in turns[5:]) < 0.2 * computed[-1]
