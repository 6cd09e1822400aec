"""BERT, an encoder (sentence-transformers' all-MiniLM-L6-v2 and the rest of the BERT family):
bidirectional attention over each whole prompt, absolute position embeddings, post-LayerNorm
layers, GELU. It runs only under the pooling runner (worker/pooling_runner.py), which hands it
whole prompts, and keeps no KV cache: nothing is decoded after a prompt, so nothing is kept.

``forward(input_ids, positions)`` → each token's last hidden state, as transformers' BertModel
``last_hidden_state`` (token type 0 for every token: one text a prompt). The sequences of a step
are the prefill chunks of the forward context's metadata; attention runs over them at once,
padded to the longest with its padding masked.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.forward_context import get_attention_metadata
from pagoda.layers.backend import current_backend
from pagoda.layers.stored_weights import PackedWeight
from pagoda.models.decode_stack import ForwardPath

_ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, hf: dict) -> BertConfig:
        act = hf.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"activation {act!r} is not supported ({', '.join(_ACTIVATIONS)})")
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {hf['position_embedding_type']!r} is not supported (absolute)")
        return cls(hf["vocab_size"], hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"],
                   hf["num_attention_heads"], hf.get("max_position_embeddings", 512), hf.get("type_vocab_size", 2),
                   hf.get("layer_norm_eps", 1e-12), act)


class SequenceBatch:
    """The step's sequences (first flat row, length), and the index that lays their tokens out as
    a padded [sequences, longest] batch for one attention call: a row past a sequence's end reads
    an extra zero row and is masked out as a key."""

    def __init__(self, spans: list[tuple[int, int]], num_tokens: int, device: torch.device) -> None:
        starts = torch.tensor([s for s, _ in spans], dtype=torch.long)
        lengths = torch.tensor([n for _, n in spans], dtype=torch.long)
        cols = torch.arange(int(lengths.max()))
        self.valid = cols[None, :] < lengths[:, None]  # [sequences, longest]
        self.index = torch.where(self.valid, starts[:, None] + cols[None, :], num_tokens).to(device)
        self.key_mask = self.valid[:, None, None, :].to(device)  # [sequences, 1, 1, longest]: keys each row sees
        self.valid = self.valid.to(device)
        self.single = len(spans) == 1

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v: [tokens, heads, head_dim] → [tokens, heads, head_dim], each token attending to
        every token of its own sequence."""
        if self.single:  # one prompt: no padding, no mask
            out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
            return out.transpose(0, 1)
        padded = [torch.cat([x, x.new_zeros(1, *x.shape[1:])])[self.index].transpose(1, 2) for x in (q, k, v)]
        out = F.scaled_dot_product_attention(*padded, attn_mask=self.key_mask)  # [sequences, heads, longest, dim]
        return out.transpose(1, 2)[self.valid]


class BertLayer(nn.Module):
    """One encoder layer, its parameters named as transformers' (``attention.self.query`` ...)."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.attention = nn.Module()
        self.attention.self = nn.Module()
        for name in ("query", "key", "value"):
            setattr(self.attention.self, name, nn.Linear(h, h))
        self.attention.output = nn.Module()
        self.attention.output.dense = nn.Linear(h, h)
        self.attention.output.LayerNorm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.intermediate = nn.Module()
        self.intermediate.dense = nn.Linear(h, cfg.intermediate_size)
        self.output = nn.Module()
        self.output.dense = nn.Linear(cfg.intermediate_size, h)
        self.output.LayerNorm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, seqs: SequenceBatch) -> torch.Tensor:
        # The projections are torch's (MKL, bias fused), as transformers computes them: pagoda's
        # small-row GEMM takes bias-free weights, and measured no faster here (benchmarks/README.md,
        # "Embeddings against sentence-transformers").
        att, heads = self.attention, self.cfg.num_heads
        q, k, v = (getattr(att.self, n)(x).view(x.shape[0], heads, -1) for n in ("query", "key", "value"))
        context = seqs.attend(q, k, v).reshape(x.shape)
        x = att.output.LayerNorm(att.output.dense(context) + x)
        inner = self.act(self.intermediate.dense(x))
        return self.output.LayerNorm(self.output.dense(inner) + x)


class BertModel(nn.Module):
    """The encoder; its hidden states go to the pooler (layers/pooler.py)."""

    uses_kv_cache = False  # the engine sizes no KV cache for it (worker/worker.py)
    classifies = False  # a cross-encoder's head scores each prompt (models/bert_classifier.py)
    CHECKPOINT_SKIPS = ("pooler.", "cls.")  # a checkpoint's heads this model has no place for

    def __init__(self, hf_config: dict, max_position: int) -> None:
        super().__init__()
        cfg = self.config = BertConfig.from_hf(hf_config)
        self.backend = current_backend()
        h = cfg.hidden_size
        self.embeddings = nn.Module()
        # `_weight`: no random init on the meta device (see models/llama.py)
        for name, rows in (("word_embeddings", cfg.vocab_size), ("position_embeddings", cfg.max_position_embeddings),
                           ("token_type_embeddings", cfg.type_vocab_size)):
            setattr(self.embeddings, name, nn.Embedding(rows, h, _weight=torch.empty(rows, h)))
        self.embeddings.LayerNorm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        spans = _sequence_spans(input_ids.shape[0])
        seqs = SequenceBatch(spans, input_ids.shape[0], input_ids.device)
        e = self.embeddings
        x = e.word_embeddings(input_ids) + e.position_embeddings(positions) + self.type_embeddings(input_ids, spans)
        x = e.LayerNorm(x)
        for layer in self.encoder.layer:
            x = layer(x, seqs)
        return x

    def type_embeddings(self, input_ids: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """Token type 0 for every token: one text a prompt (a cross-encoder's pairs differ)."""
        return self.embeddings.token_type_embeddings.weight[0]

    # -- what the engine asks of a model ----------------------------------------------------
    def attention_layers(self) -> list:
        return []  # no paged attention: nothing to bind a KV cache to

    def choose_forward(self, refused: str | None = None) -> ForwardPath:
        return ForwardPath(False, "an encoder: each step runs whole prompts through the Python layers, no decode steps")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError("BertModel is an encoder: it pools hidden states, it has no logits to sample")

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """transformers' names, with or without a ``bert.`` prefix (a BertForMaskedLM checkpoint);
        the checkpoint's pooler and heads are not this model's (the pooler is the engine's)."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("bert.")
            if name.startswith(self.CHECKPOINT_SKIPS) or name.endswith("position_ids"):
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in BertModel")
            if tuple(params[name].shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(params[name].shape)}")
            params[name].copy_(tensor.dequantize() if isinstance(tensor, PackedWeight) else tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")


def _sequence_spans(num_tokens: int) -> list[tuple[int, int]]:
    """(first flat row, length) of each prompt of the step: the pooling runner lays an encoder's
    prompts out as whole prefill chunks, with nothing cached before them."""
    meta = get_attention_metadata()
    if meta.num_decodes or any(seq.start for seq in meta.prefills):
        raise RuntimeError("an encoder takes whole prompts as prefill chunks (the pooling runner lays them out so)")
    spans = [(seq.token_start, seq.query_len) for seq in meta.prefills]
    if sum(n for _, n in spans) != num_tokens:
        raise RuntimeError(f"the step's prompts cover {sum(n for _, n in spans)} of its {num_tokens} tokens")
    return spans
