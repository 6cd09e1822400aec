"""The Batch API and durable state on real servers through the openai SDK: a batch's answers are
the routes' own answers, failures go to the error file, bad files fail validation, a batch can be
cancelled, runs below interactive work, and resumes after the server is killed; sessions and
stored responses outlive a restart; `pagoda run-batch` answers a file offline alike."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import openai
import pytest
from server_process import start_server, stop_process

QUESTIONS = ["What is the capital of France?", "Name a color.", "Count to three.", "Say hello."]


def _line(i: int, body: dict, url: str = "/v1/chat/completions") -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}


def _chat_body(question: str, max_tokens: int = 8) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0}


def _jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


def _submit(client: openai.OpenAI, lines: list[dict], endpoint: str = "/v1/chat/completions"):
    file = client.files.create(file=("batch.jsonl", _jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=file.id, endpoint=endpoint, completion_window="24h")


def _wait(client: openai.OpenAI, batch_id: str, done=lambda b: b.status in ("completed", "failed", "cancelled",
                                                                             "expired"), timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if done(batch):
            return batch
        time.sleep(0.1)  # polling for a state, as a client does; nothing depends on its length
    raise AssertionError(f"batch {batch_id} did not get there: {client.batches.retrieve(batch_id)}")


def _lines_of(client: openai.OpenAI, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    text = client.files.content(file_id).text
    return {item["custom_id"]: item for item in map(json.loads, text.splitlines())}


@pytest.fixture(scope="module")
def base(long_tiny_llama, tmp_path_factory):
    # two batch lines at a time, so that a long batch is still running when a test acts on it
    proc, base = start_server(long_tiny_llama, "--max-model-len", "2048", "--batch-concurrency", "2",
                              "--state-dir", str(tmp_path_factory.mktemp("state")))
    yield base
    stop_process(proc)


def test_a_batch_answers_as_the_routes_do_and_files_its_failures(base):
    client = _client(base)
    lines = [_line(i, _chat_body(q)) for i, q in enumerate(QUESTIONS)]
    lines.append(_line(9, {**_chat_body("bad"), "temperature": -1}))
    batch = _wait(client, _submit(client, lines).id)
    assert batch.status == "completed" and batch.completed_at and batch.output_file_id and batch.error_file_id
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (5, 4, 1)
    answers = _lines_of(client, batch.output_file_id)
    for i, question in enumerate(QUESTIONS):
        direct = client.chat.completions.create(**_chat_body(question))
        answer = answers[f"req-{i}"]["response"]
        assert answer["status_code"] == 200
        assert answer["body"]["choices"][0]["message"]["content"] == direct.choices[0].message.content
    (failure,) = _lines_of(client, batch.error_file_id).values()
    assert failure["custom_id"] == "req-9" and failure["response"]["status_code"] == 400
    assert failure["response"]["body"]["error"]["param"] == "temperature"
    assert batch.id in [b.id for b in client.batches.list().data]


def test_completions_and_responses_batches(base):
    client = _client(base)
    prompt = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
    done = _wait(client, _submit(client, [_line(0, prompt, "/v1/completions")], "/v1/completions").id)
    (answer,) = _lines_of(client, done.output_file_id).values()
    assert answer["response"]["body"]["choices"][0]["text"] == client.completions.create(**prompt).choices[0].text
    request = {"model": "tiny", "input": "Say hello.", "max_output_tokens": 6, "temperature": 0}
    done = _wait(client, _submit(client, [_line(0, request, "/v1/responses")], "/v1/responses").id)
    (answer,) = _lines_of(client, done.output_file_id).values()
    stored = client.responses.retrieve(answer["response"]["body"]["id"])  # kept, as a response is
    assert stored.output_text == client.responses.create(**request).output_text


def test_a_bad_file_fails_validation_with_its_lines_named(base):
    client = _client(base)
    lines = [_line(0, _chat_body("ok")), _line(0, _chat_body("twice")), _line(2, _chat_body("x"), "/v1/embeddings")]
    batch = _wait(client, _submit(client, lines).id)
    assert batch.status == "failed" and batch.failed_at
    assert [(e.code, e.line) for e in batch.errors.data] == [("duplicate_custom_id", 2), ("invalid_url", 3)]
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=lines and client.files.create(
            file=("x.jsonl", _jsonl(lines)), purpose="batch").id, endpoint="/v1/nope", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")


def test_a_cancelled_batch_stops_and_files_what_it_answered(base):
    client = _client(base)
    lines = [_line(i, {**_chat_body(f"Tell a long story number {i}.", max_tokens=200), "ignore_eos": True})
             for i in range(60)]
    batch = _submit(client, lines)
    _wait(client, batch.id, lambda b: b.request_counts.completed >= 1)
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = _wait(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    assert 1 <= done.request_counts.completed < 60
    assert len(_lines_of(client, done.output_file_id)) == done.request_counts.completed


def test_batch_work_yields_to_interactive_requests(long_tiny_llama, tmp_path):
    """One sequence slot: while a batch fills it, an interactive request preempts the batch
    line and is answered long before the batch is done."""
    proc, base = start_server(long_tiny_llama, "--max-num-seqs", "1", "--state-dir", str(tmp_path))
    try:
        client = _client(base)
        lines = [_line(i, _chat_body(f"Story {i}.", max_tokens=64)) for i in range(30)]
        batch = _submit(client, lines)
        _wait(client, batch.id, lambda b: b.request_counts.completed >= 1)
        started = time.monotonic()
        client.chat.completions.create(**_chat_body("Interactive question", max_tokens=16))
        interactive = time.monotonic() - started
        state = client.batches.retrieve(batch.id)
        assert state.status == "in_progress" and state.request_counts.completed < 30, (interactive, state)
    finally:
        stop_process(proc)


def test_state_outlives_a_killed_server(long_tiny_llama, tmp_path):
    """kill -9 mid-batch: the restarted server resumes the batch (each line answered once), and
    has the session and the stored response it had."""
    args = ("--max-num-seqs", "2", "--state-dir", str(tmp_path))
    proc, base = start_server(long_tiny_llama, *args)
    client = _client(base)
    session = httpx.post(f"{base}/v1/sessions", json={"system": "Be brief.", "max_tokens": 6, "temperature": 0},
                         timeout=30).json()["id"]
    turn = httpx.post(f"{base}/v1/sessions/{session}/messages", json={"content": "Hello there"}, timeout=60).json()
    first = client.responses.create(model="tiny", input="alpha bravo", max_output_tokens=6, temperature=0)
    lines = [_line(i, _chat_body(f"Story {i}.", max_tokens=48)) for i in range(24)]
    batch = _submit(client, lines)
    _wait(client, batch.id, lambda b: b.request_counts.completed >= 2)
    proc.kill()
    proc.wait()
    proc, base = start_server(long_tiny_llama, *args)
    try:
        client = _client(base)
        done = _wait(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 24
        answers = _lines_of(client, done.output_file_id)
        assert sorted(answers) == sorted(line["custom_id"] for line in lines)
        history = httpx.get(f"{base}/v1/sessions/{session}", timeout=10).json()
        assert history["messages"][-1]["content"] == turn["choices"][0]["message"]["content"]
        again = httpx.post(f"{base}/v1/sessions/{session}/messages", json={"content": "And again"}, timeout=60).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # a new process: nothing cached ...
        assert again["usage"]["prompt_tokens"] > turn["usage"]["prompt_tokens"]  # ... but the history is there
        assert client.responses.retrieve(first.id).output_text == first.output_text
        second = client.responses.create(model="tiny", previous_response_id=first.id, input="charlie",
                                         max_output_tokens=6, temperature=0)
        assert second.usage.input_tokens > first.usage.total_tokens
    finally:
        stop_process(proc)


def test_run_batch_answers_a_file_offline(base, long_tiny_llama, tmp_path):
    lines = [_line(i, {**_chat_body(q), "model": str(long_tiny_llama)}) for i, q in enumerate(QUESTIONS[:2])]
    lines.append(_line(5, {"model": str(long_tiny_llama), "prompt": "Once upon a time", "max_tokens": 6,
                           "temperature": 0}, "/v1/completions"))
    (tmp_path / "in.jsonl").write_bytes(_jsonl(lines))
    subprocess.run([sys.executable, "-m", "pagoda.cli", "run-batch", "-i", str(tmp_path / "in.jsonl"), "-o",
                    str(tmp_path / "out.jsonl"), "--model", str(long_tiny_llama), "--dtype", "float32",
                    "--kv-cache-memory", "0.02"], check=True, timeout=300, capture_output=True)
    answers = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [a["custom_id"] for a in answers] == ["req-0", "req-1", "req-5"]
    client = _client(base)
    for answer, question in zip(answers[:2], QUESTIONS):
        direct = client.chat.completions.create(**_chat_body(question))
        assert answer["response"]["body"]["choices"][0]["message"]["content"] == direct.choices[0].message.content
    assert answers[2]["response"]["body"]["choices"][0]["text"] == client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0).choices[0].text
