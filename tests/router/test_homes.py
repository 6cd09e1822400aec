"""The router and what replicas keep (pagoda/router/homes.py): a conversation by
previous_response_id, a streamed response, a file and the batch job that reads it, each reached
at the replica that keeps it through `pagoda router` in front of two replicas; the lists are
both replicas' lists; Anthropic's Messages pass through too."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import openai
import pytest

from router_processes import RouterProcess, start_replicas, stop
from pagoda.router.homes import Homes, created_id, merged_list, named_thing
from pagoda.router.proxy import WORKER_HEADER


def test_which_thing_a_request_names():
    assert named_thing("GET", "/v1/responses/resp_1/input_items?limit=2", None) == "resp_1"
    assert named_thing("DELETE", "/v1/files/file-9", None) == "file-9"
    assert named_thing("POST", "/v1/batches/batch_3/cancel", None) == "batch_3"
    assert named_thing("POST", "/v1/responses", {"previous_response_id": "resp_2", "input": "x"}) == "resp_2"
    assert named_thing("POST", "/v1/batches", {"input_file_id": "file-4"}) == "file-4"
    assert named_thing("POST", "/v1/responses", {"input": "x"}) is None
    assert named_thing("GET", "/v1/files", None) is None and named_thing("POST", "/v1/chat/completions", {}) is None
    assert created_id("POST", "/v1/files", 200, b'{"id": "file-1", "object": "file"}') == "file-1"
    assert created_id("POST", "/v1/files", 400, b'{"id": "x"}') is None
    assert created_id("POST", "/v1/chat/completions", 200, b'{"id": "chatcmpl-1"}') is None
    homes = Homes(capacity=2)
    for thing in ("a", "b", "c"):
        homes.remember(thing, f"http://{thing}")
    assert homes.get("a") is None and homes.get("c") == "http://c"  # the least recently used went
    homes.forget_worker("http://c")
    assert homes.get("c") is None
    merged = json.loads(merged_list([b'{"data": [{"id": "x", "created_at": 1}]}', b'not json',
                                     b'{"data": [{"id": "y", "created_at": 2}]}']))
    assert [item["id"] for item in merged["data"]] == ["y", "x"] and merged["has_more"] is False


@pytest.fixture(scope="module")
def cluster(long_tiny_llama):
    started = start_replicas(long_tiny_llama, 2, "--max-model-len", "2048", "--state-dir", "none")
    router = RouterProcess([base for _, base in started], "--policy", "round_robin")
    yield router, [base for _, base in started]
    router.stop()
    for proc, _ in started:
        stop(proc)


def test_a_conversation_stays_where_its_responses_are(cluster):
    router, replicas = cluster
    client = openai.OpenAI(base_url=f"{router.base}/v1", api_key="none", max_retries=0)
    raw = client.responses.with_raw_response.create(model="tiny", input="alpha", max_output_tokens=4, temperature=0)
    response, home = raw.parse(), raw.headers[WORKER_HEADER]
    for turn in range(4):  # round robin would send every other call elsewhere
        raw = client.responses.with_raw_response.create(model="tiny", previous_response_id=response.id,
                                                        input=f"turn {turn}", max_output_tokens=4, temperature=0)
        response = raw.parse()
        assert raw.headers[WORKER_HEADER] == home and response.previous_response_id
        assert client.responses.retrieve(response.id).id == response.id
    with client.responses.stream(model="tiny", input="streamed", max_output_tokens=4, temperature=0) as stream:
        streamed = list(stream)[-1].response  # response.incomplete: cut at max_output_tokens
    for _ in range(2):  # the router did not read the stream: it looks for the response on each replica
        assert client.responses.retrieve(streamed.id).output_text == streamed.output_text
    assert [i.type for i in client.responses.input_items.list(streamed.id, limit=1).data] == ["message"]
    client.responses.delete(streamed.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(streamed.id)


def test_a_batch_runs_where_its_file_is_and_lists_cover_both_replicas(cluster):
    router, replicas = cluster
    client = openai.OpenAI(base_url=f"{router.base}/v1", api_key="none", max_retries=0)
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}}
    files = [client.files.create(file=(f"in{i}.jsonl", json.dumps(line).encode()), purpose="batch")
             for i in range(2)]
    homes = {httpx.get(f"{base}/v1/files/{f.id}").status_code == 200 and base for f in files for base in replicas}
    assert set(replicas) <= homes  # round robin put one on each replica
    assert {f.id for f in files} <= {f.id for f in client.files.list().data}
    batch = client.batches.create(input_file_id=files[1].id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while (done := client.batches.retrieve(batch.id)).status != "completed":
        assert time.monotonic() < deadline and done.status not in ("failed", "cancelled"), done
        time.sleep(0.1)
    (answer,) = client.files.content(done.output_file_id).text.splitlines()
    assert json.loads(answer)["response"]["status_code"] == 200
    assert batch.id in {b.id for b in client.batches.list().data}
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve("file-nowhere")


def test_anthropic_messages_pass_through(cluster):
    router, _ = cluster
    message = anthropic.Anthropic(base_url=router.base, api_key="none", max_retries=0).messages.create(
        model="tiny", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert message.type == "message" and message.usage.output_tokens >= 1
