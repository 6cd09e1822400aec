"""pagoda.lang programs on the in-process engine and on a real server."""

from __future__ import annotations

import json
import re

import pytest

from pagoda import lang


@pytest.fixture(scope="module")
def engine(tiny_llm):
    return lang.Engine(llm=tiny_llm)


@lang.function
def structured_generation(s):
    # The seed's example, as written there (with pagoda.lang for sglang).
    s += "请以JSON格式输出:\n"
    s += {"name": lang.gen("姓名", max_len=8)}
    s += {"age": lang.gen("年龄", regex="[0-9]+")}
    return s


def _check_seed_example(state, tokenizer) -> None:
    header, body = state.text().split("\n", 1)
    assert header == "请以JSON格式输出:"
    obj = json.loads(body)
    assert set(obj) == {"name", "age"} and isinstance(obj["age"], int)
    assert obj["name"] == state["姓名"] and str(obj["age"]) == state["年龄"]
    assert state.meta("姓名").completion_tokens <= 8
    assert re.fullmatch(r"[0-9]+", state["年龄"])


def test_seed_example_on_the_tiny_model(engine, tiny_llm):
    _check_seed_example(structured_generation.run(backend=engine), tiny_llm.engine.tokenizer)


@pytest.mark.slow
def test_seed_example_on_smollm2(smollm2_gguf):
    smol = lang.Engine("smollm2", kv_cache_memory=0.3)
    states = structured_generation.run_batch([{}] * 3, backend=smol)
    for state in states:
        _check_seed_example(state, smol.llm.engine.tokenizer)


@lang.function
def chat(s, question):
    s += lang.system("Answer briefly.")
    s += lang.user(question)
    s += lang.assistant(lang.gen("answer", max_tokens=8))
    s += lang.user("Is that right?")
    s += lang.assistant(lang.select("verdict", ["yes", "no", "unsure"]))


def test_roles_follow_the_chat_template_and_select_picks_a_choice(engine, tiny_llm):
    state = chat.run("Hello?", backend=engine)
    assert state["verdict"] in ("yes", "no", "unsure")
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello?"},
                {"role": "assistant", "content": state["answer"]}, {"role": "user", "content": "Is that right?"},
                {"role": "assistant", "content": state["verdict"]}]
    assert state.text() == tiny_llm.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=False)


@lang.function
def branches(s, n):
    s += "A shared prefix that is long enough to fill several KV blocks of sixteen tokens each. " * 3
    forks = s.fork(n)
    for i, branch in enumerate(forks):
        branch += f" Branch {i}:"
        branch += lang.gen("tail", max_tokens=6, temperature=1.0, seed=i)
    s.forks = forks.join()


def test_fork_branches_share_the_cached_prefix(engine, tiny_llm):
    state = branches.run(3, backend=engine)
    assert len(state.forks) == 3
    prefix_blocks = len(tiny_llm.engine.tokenizer.encode(state.text())) // 16
    for branch in state.forks:
        assert branch.text().startswith(state.text())
        # Every full block of the shared prefix (but one, where the branch's own text may
        # tokenize across the boundary) comes from the cache.
        assert branch.meta("tail").cached_tokens >= (prefix_blocks - 1) * 16 > 0


@lang.function
def numbered(s, i):
    s += f"Item {i}: "
    s += lang.gen("n", regex=r"[0-9]{2}", temperature=1.0, seed=i)


def test_run_batch_keeps_order_and_each_constraint(engine):
    states = numbered.run_batch([{"i": i} for i in range(6)], backend=engine)
    for i, state in enumerate(states):
        assert state.text().startswith(f"Item {i}: ") and re.fullmatch(r"[0-9]{2}", state["n"])


def test_program_errors_are_clear(engine):
    with pytest.raises(ValueError, match="one of regex, choices, json_schema"):
        lang.gen("x", regex="a", choices=["b"])

    @lang.function
    def bad(s):
        s += 3.5

    with pytest.raises(TypeError, match="cannot append float"):
        bad.run(backend=engine)
    lang.set_default_backend(None)
    with pytest.raises(ValueError, match="no backend"):
        numbered.run(1)


def test_endpoint_backend_matches_the_in_process_engine(tiny_llama, engine):
    from server_process import start_server as _start

    proc, base = _start(tiny_llama)
    try:
        remote = lang.Endpoint(base)
        for program, args in ((structured_generation, ()), (chat, ("Hello?",))):
            assert program.run(*args, backend=remote).text() == program.run(*args, backend=engine).text()
        assert branches.run(2, backend=remote).forks[1].meta("tail").cached_tokens > 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_failed_step_fails_the_waiting_programs_once_and_the_engine_goes_on(tiny_llama, monkeypatch):
    """A step that raises reaches every program waiting on it, once: the engine aborts its
    requests (freeing their blocks) instead of stepping the broken batch again and again."""
    from pagoda import LLM

    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory=0.02)
    engine = lang.Engine(llm=llm)
    core = llm.engine.core
    real_step, calls = core.step, []

    def failing_step():
        calls.append(1)
        raise RuntimeError("boom")

    monkeypatch.setattr(core, "step", failing_step)
    with pytest.raises(RuntimeError, match="boom"):
        numbered.run(1, backend=engine)
    assert len(calls) == 1  # no spinning on the failed batch
    assert not llm.engine.has_unfinished_requests() and core.kv_manager.usage() == 0.0
    monkeypatch.setattr(core, "step", real_step)
    assert numbered.run(1, backend=engine).text()  # the engine serves the next program
