"""A cross-encoder (BertForSequenceClassification, one label: a reranker) on the pooling runner:
each (query, document) pair read as one prompt, the second text as token type 1, scored by the
model's head; the scores equal transformers' sigmoid of the logits on the same weights, offline
(`LLM.score`) and through /v1/score and /v1/rerank; it gives no embeddings."""

from __future__ import annotations

import httpx
import pytest
import torch
from server_process import start_server, stop_process
from tiny_models import make_tiny_cross_encoder

QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital of france", "the quick brown fox", "berlin is the capital of germany",
             "a man is eating food"]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    return make_tiny_cross_encoder(tmp_path_factory.mktemp("reranker"))


@pytest.fixture(scope="module")
def reference(reranker) -> list[float]:
    """transformers' scores of (QUERY, document): the pair tokenized together, sigmoid of the logit."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(reranker)
    model = transformers.BertForSequenceClassification.from_pretrained(reranker).eval()
    batch = tokenizer([QUERY] * len(DOCUMENTS), DOCUMENTS, padding=True, return_tensors="pt")
    assert batch["token_type_ids"].any()  # the second text's tokens are type 1
    with torch.no_grad():
        return torch.sigmoid(model(**batch).logits[:, 0]).tolist()


def test_llm_score_equals_transformers(reranker, reference):
    from pagoda import LLM

    llm = LLM(model=str(reranker), kv_cache_memory=0.02)
    scores = [o.outputs.score for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
    assert scores == pytest.approx(reference, abs=1e-5)
    alone = llm.score(QUERY, DOCUMENTS[2], use_tqdm=False)[0].outputs.score
    assert alone == pytest.approx(reference[2], abs=1e-5)  # alone as in a batch
    with pytest.raises(ValueError, match="cross-encoder"):
        llm.embed(["hello"], use_tqdm=False)
    llm.shutdown()


def test_score_and_rerank_routes(reranker, reference):
    proc, base = start_server(reranker, "--dtype", "float32")
    try:
        score = httpx.post(f"{base}/v1/score", json={"text_1": QUERY, "text_2": DOCUMENTS}, timeout=60).json()
        assert [d["score"] for d in score["data"]] == pytest.approx(reference, abs=1e-5)
        rerank = httpx.post(f"{base}/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2},
                            timeout=60).json()
        best = sorted(range(len(DOCUMENTS)), key=lambda i: -reference[i])[:2]
        assert [r["index"] for r in rerank["results"]] == best
        assert [r["relevance_score"] for r in rerank["results"]] == pytest.approx([reference[i] for i in best], abs=1e-5)
        refused = httpx.post(f"{base}/v1/embeddings", json={"input": "hello"}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"
        assert "cross-encoder" in refused.json()["error"]["message"]
    finally:
        stop_process(proc)
