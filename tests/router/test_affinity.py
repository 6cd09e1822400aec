"""Session keys and prompt text: explicit keys first, and the turns of one chat hash alike."""

from __future__ import annotations

from starlette.datastructures import Headers

from pagoda.router.affinity import MAX_PROMPT_CHARS, route_request


def _chat(*contents: str, system: str | None = "be brief") -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    roles = ["user", "assistant"]
    messages += [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]
    return {"model": "m", "messages": messages}


def test_header_wins_over_user_which_wins_over_the_derived_key():
    body = {**_chat("hi"), "user": "u1"}
    assert route_request(Headers({"x-session-id": "s1"}), body).key == "s1"
    assert route_request(Headers({}), body).key == "user:u1"
    derived = route_request(Headers({}), _chat("hi"))
    assert derived.session_key is None and derived.key.startswith("prefix:")


def test_turns_of_one_chat_share_a_derived_key_and_other_chats_do_not():
    turn1 = route_request(Headers({}), _chat("where is Paris?"))
    turn3 = route_request(Headers({}), _chat("where is Paris?", "in France", "and Rome?"))
    other = route_request(Headers({}), _chat("where is Oslo?"))
    assert turn1.key == turn3.key != other.key
    assert turn3.prompt_text.startswith(turn1.prompt_text[:-1])


def test_prompt_forms():
    text = route_request(Headers({}), {"prompt": "once upon a time"})
    assert text.prompt_text == "once upon a time"
    ids = route_request(Headers({}), {"prompt": [1, 2, 3]})
    longer = route_request(Headers({}), {"prompt": [1, 2, 3, 4]})
    assert longer.prompt_text.startswith(ids.prompt_text)
    assert route_request(Headers({}), {"prompt": ["a batch", "b"]}).prompt_text == "a batch"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert "hi" in route_request(Headers({}), parts).prompt_text
    huge = route_request(Headers({}), {"prompt": "x" * (MAX_PROMPT_CHARS * 2)})
    assert len(huge.prompt_text) == MAX_PROMPT_CHARS


def test_bodies_without_a_prompt_get_no_affinity():
    a, b = route_request(Headers({}), None), route_request(Headers({}), {"input": "x"})
    assert a.key != b.key and a.prompt_text == "" == b.prompt_text
