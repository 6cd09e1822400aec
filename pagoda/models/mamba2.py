"""Mamba-2 (``Mamba2ForCausalLM``): a stack of Mamba-2 mixers, no attention and no KV cache.

Each block is ``x + mixer(norm(x))`` (layers/mamba_mixer.py), the residual stream in fp32 when
``residual_in_fp32`` (the default, as transformers keeps it); a final RMSNorm and the output head
follow. Every request's context lives in its state slot of each layer (the engine allocates
them beside the, here empty, paged KV cache: worker/state_cache.py), so decode costs the same at
any context length.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from pagoda.distributed.parallel_state import current_group
from pagoda.layers.backend import current_backend
from pagoda.layers.linear import project
from pagoda.layers.mamba_mixer import Mamba2Mixer, MambaConfig
from pagoda.layers.norm import RMSNorm
from pagoda.layers.packed_weights import packed_of
from pagoda.models.decode_stack import ForwardPath
from pagoda.models.llama import _copy_checked as copy_checked


@dataclass(frozen=True)
class Mamba2Config:
    """What the engine reads of the model (``vocab_size``; ``num_layers``, ``head_dim`` and
    ``num_kv_heads`` size its KV cache, which is empty: no layer attends)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    norm_eps: float
    tie_word_embeddings: bool
    residual_in_fp32: bool
    mixer: MambaConfig
    head_dim: int = 1
    num_kv_heads: int = 1


class Mamba2Block(nn.Module):
    def __init__(self, cfg: Mamba2Config) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mixer = Mamba2Mixer(cfg.mixer)

    def forward(self, hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return hidden + self.mixer(self.norm(hidden.to(dtype)))


def refuse_tensor_parallel(name: str) -> None:
    """The mixers are built whole: their heads are not cut across ranks."""
    if current_group().is_parallel:
        raise ValueError(f"{name}: tensor parallelism is not supported for state-space layers")


class Mamba2ForCausalLM(nn.Module):
    uses_kv_cache = False  # the engine sizes no KV cache for it (worker/worker.py)

    def __init__(self, hf_config: dict, max_position: int) -> None:
        super().__init__()
        refuse_tensor_parallel(type(self).__name__)
        self.config = cfg = Mamba2Config(
            hf_config["vocab_size"], hf_config["hidden_size"], hf_config["num_hidden_layers"],
            float(hf_config.get("layer_norm_epsilon", 1e-5)), bool(hf_config.get("tie_word_embeddings", False)),
            bool(hf_config.get("residual_in_fp32", True)), MambaConfig.from_hf(hf_config))
        self.backend = current_backend()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                       _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Mamba2Block(cfg) for _ in range(cfg.num_layers))
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    # -- what the engine asks of a model ----------------------------------------------------
    def attention_layers(self) -> list:
        return []

    def state_layers(self) -> list[Mamba2Mixer]:
        return [layer.mixer for layer in self.layers]

    def choose_forward(self, refused: str | None = None) -> ForwardPath:
        return ForwardPath(False, "state-space layers: every step runs the Python layers")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embeddings(input_ids)
        dtype = hidden.dtype
        if self.config.residual_in_fp32:
            hidden = hidden.float()
        for layer in self.layers:
            hidden = layer(hidden, dtype)
        return self.norm_f(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight_dtype = self.embeddings.weight.dtype
        if self.lm_head is None:
            return self.backend.linear(hidden.to(weight_dtype), self.embeddings.weight, packed_of(self.embeddings))
        return project(self.lm_head, hidden.to(weight_dtype), self.backend)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """transformers' names (``backbone.``, the old ``embedding.`` as well as ``embeddings.``)."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            name = name.removeprefix("backbone.").replace("embedding.", "embeddings.")
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            copy_checked(params[name].data, tensor, name)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
