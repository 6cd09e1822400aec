"""A BERT cross-encoder (`BertForSequenceClassification`, the rerankers of the ms-marco family):
the query and a document go in as one prompt, `[CLS] query [SEP] document [SEP]`, the second text
marked token type 1; the first token's hidden state goes through BERT's pooler (dense + tanh)
and the classifier to a score. One label is a relevance score, turned to [0, 1] by a sigmoid
(as sentence-transformers' CrossEncoder and vLLM give it); several labels, a softmax.

The pooling runner (worker/pooling_runner.py) pools the first token (CLS) and calls `classify`;
the serving layer makes the pairs (/v1/score, /v1/rerank, `LLM.score`).
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.models.bert import BertModel


class BertForSequenceClassification(BertModel):
    classifies = True
    CHECKPOINT_SKIPS = ("cls.",)  # its pooler is this model's, the checkpoint's own

    def __init__(self, hf_config: dict, max_position: int) -> None:
        super().__init__(hf_config, max_position)
        if "sep_token_id" not in hf_config:
            raise ValueError("a cross-encoder needs its tokenizer's [SEP] id (sep_token_id) to mark a pair's second text")
        self.sep_token_id = int(hf_config["sep_token_id"])
        self.num_labels = int(hf_config.get("num_labels") or len(hf_config.get("id2label") or {}) or 2)
        h = self.config.hidden_size
        self.pooler = nn.Module()
        self.pooler.dense = nn.Linear(h, h)
        self.classifier = nn.Linear(h, self.num_labels)

    def type_embeddings(self, input_ids: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """Token type 1 for every token after a prompt's first [SEP] (a pair's second text)."""
        types = torch.zeros_like(input_ids)
        for start, length in spans:
            seps = (input_ids[start:start + length] == self.sep_token_id).nonzero()
            if len(seps):
                types[start + int(seps[0]) + 1:start + length] = 1
        return self.embeddings.token_type_embeddings(types)

    def classify(self, first_tokens: torch.Tensor) -> torch.Tensor:
        """[prompts, hidden] (each prompt's first token) → [prompts, labels]: probabilities."""
        logits = self.classifier(torch.tanh(self.pooler.dense(first_tokens)))
        return torch.sigmoid(logits) if self.num_labels == 1 else torch.softmax(logits, dim=-1)
