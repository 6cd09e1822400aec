"""BERT (models/bert.py) through the pooling runner against transformers' BertModel: a tiny random
encoder's pooled vectors equal transformers' last hidden states pooled the same way (mean over
the prompt, or its first token; normalized), whether the texts run together or one at a time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.engine.llm import LLM
from tiny_models import make_tiny_bert

TEXTS = ["The quick brown fox jumps over the lazy dog.", "hello", "Paris is the capital of France. " * 4,
         "def main(): print('hello world')", "numbers like 3.14159 and 2718 appear too"]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    return make_tiny_bert(tmp_path_factory.mktemp("bert") / "plain", seed=3)


@pytest.fixture(scope="module")
def reference(tiny_bert):
    """transformers' last hidden states of each text (and its token ids)."""
    import transformers
    from tokenizers import Tokenizer

    model = transformers.BertModel.from_pretrained(tiny_bert, add_pooling_layer=False).eval()
    tok = Tokenizer.from_file(str(tiny_bert / "tokenizer.json"))
    out = []
    with torch.no_grad():
        for text in TEXTS:
            ids = tok.encode(text).ids
            out.append((ids, model(torch.tensor([ids])).last_hidden_state[0]))
    return out


@pytest.mark.parametrize("pooling", ["MEAN", "CLS"])
def test_pooled_vectors_equal_transformers_batched_or_not(tiny_bert, reference, pooling):
    llm = LLM(str(tiny_bert), pooler_config=f'{{"pooling_type": "{pooling}"}}')
    try:
        assert llm.engine.config.model.runner == "pooling"  # an encoder pools without --runner
        together = llm.embed(TEXTS, use_tqdm=False)
        alone = [llm.embed(text, use_tqdm=False)[0] for text in TEXTS]
    finally:
        llm.shutdown()
    for (ids, hidden), a, b in zip(reference, together, alone):
        expected = F.normalize(hidden.mean(0) if pooling == "MEAN" else hidden[0], dim=-1)
        assert a.prompt_token_ids == ids
        torch.testing.assert_close(a.outputs.data, expected, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(b.outputs.data, a.outputs.data, atol=2e-6, rtol=1e-5)


def test_an_encoder_cannot_generate(tiny_bert):
    from pagoda.config import EngineArgs, create_engine_config

    with pytest.raises(ValueError, match="encoder: it cannot generate"):
        create_engine_config(EngineArgs(model=str(tiny_bert), runner="generate"))
    with pytest.raises(ValueError, match="an encoder \\(BertModel\\) runs on one rank"):
        create_engine_config(EngineArgs(model=str(tiny_bert), tensor_parallel_size=2))
