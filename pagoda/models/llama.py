"""The Llama decoder (Llama 2/3, Mistral, SmolLM2), and the Qwen2 / Qwen3 variants of it.

Qwen2 adds biases to the q/k/v projections; Qwen3 adds an RMSNorm over each head of q and k.
Q/K/V and gate/up are merged into one matmul each; the weight loader stacks the checkpoint's
separate tensors into them. A layer with a sliding window (``TransformerConfig.sliding_windows``:
Mistral's ``sliding_window`` on every layer, Qwen's ``use_sliding_window``) attends to its last
``window`` positions only. Other families (models/gemma3.py) build on these classes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from pagoda.distributed.parallel_state import TensorParallelGroup, current_group
from pagoda.distributed.shard_plan import ShardPlan
from pagoda.forward_context import get_attention_metadata
from pagoda.layers.attention import PagedAttention
from pagoda.layers.backend import current_backend
from pagoda.layers.linear import project
from pagoda.layers.norm import RMSNorm
from pagoda.layers.packed_weights import packed_of
from pagoda.layers.quantization import QUANTIZED_LINEARS
from pagoda.layers.rotary import RotaryEmbedding
from pagoda.layers.stored_weights import PackedWeight, keeps_packed
from pagoda.models.config import TransformerConfig
from pagoda.models.decode_stack import DecodeStack, ForwardPath, choose_decode_stack
from pagoda.models.layer_readiness import LayerReadiness


class Attention(nn.Module):
    """Self-attention over this rank's heads (all of them at tensor-parallel size 1).

    ``sliding_window``: this layer's window (None: global attention); ``scale``: the query scale
    (default ``head_dim ** -0.5``)."""

    def __init__(self, cfg: TransformerConfig, rotary: RotaryEmbedding, plan: ShardPlan, tp: TensorParallelGroup,
                 sliding_window: int | None = None, scale: float | None = None) -> None:
        super().__init__()
        self.tp, self.backend = tp, current_backend()
        self.num_heads, self.num_kv_heads, self.head_dim = plan.num_heads, plan.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary  # one table shared by all layers
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, cfg.head_dim,
                                   scale=cfg.head_dim**-0.5 if scale is None else scale, sliding_window=sliding_window)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = project(self.qkv_proj, x, self.backend)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.tp.all_reduce(project(self.o_proj, self.attn(q, k, v), self.backend))  # row-parallel: sum the ranks' parts


# config activation → the backend's fused "act(gate) * up" (SwiGLU; Gemma's tanh-approximated GeGLU)
_GATED_ACTIVATIONS = {"silu": "silu_and_mul", "swish": "silu_and_mul", "gelu_pytorch_tanh": "gelu_tanh_and_mul",
                      "gelu_tanh": "gelu_tanh_and_mul"}


class MLP(nn.Module):
    def __init__(self, cfg: TransformerConfig, plan: ShardPlan, tp: TensorParallelGroup) -> None:
        super().__init__()
        if cfg.hidden_act not in _GATED_ACTIVATIONS:
            raise ValueError(f"activation {cfg.hidden_act!r} is not supported ({', '.join(_GATED_ACTIVATIONS)})")
        self.tp, self.backend = tp, current_backend()
        self.act_and_mul = getattr(self.backend, _GATED_ACTIVATIONS[cfg.hidden_act])
        self.intermediate_size = plan.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = self.act_and_mul(project(self.gate_up_proj, x, self.backend))
        return self.tp.all_reduce(project(self.down_proj, act, self.backend))  # row-parallel: sum the ranks' parts


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig, rotary: RotaryEmbedding, plan: ShardPlan, tp: TensorParallelGroup,
                 index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary, plan, tp, sliding_window=cfg.window(index))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, plan, tp)

    def forward(self, positions, hidden, residual):
        if residual is None:  # first layer: 0 + x == x exactly, and every layer takes one path
            residual = torch.zeros_like(hidden)
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


# checkpoint name fragment → (merged parameter fragment, shard index)
_STACKED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class LlamaForCausalLM(nn.Module):
    """forward(input_ids, positions) → hidden states; compute_logits(hidden) → logits.

    Built inside ``parallel_state.building_with(group)``, it holds one tensor-parallel rank's
    shard (distributed/shard_plan.py): parameters have the rank's shapes, and ``weight_slice``
    tells the loader which part of each checkpoint tensor to read."""

    qk_norm = False
    attention_bias: bool | None = None  # None: read config.json
    decode_stack: DecodeStack | None = None  # chosen by choose_forward once the KV cache is bound
    # while the loader fills the model layer by layer (loader/progressive_load.py): what is in place;
    # None once every layer is, so a step then checks nothing
    loading: LayerReadiness | None = None
    load_readiness: LayerReadiness | None = None  # the same, kept once loaded (its progress, for /health)

    def __init__(self, hf_config: dict, max_position: int) -> None:
        super().__init__()
        cfg = self.read_config(hf_config)
        self.config = cfg
        self.tp = tp = current_group()
        self.backend = current_backend()  # the kernels every layer runs (layers/backend.py)
        self.shards = plan = ShardPlan.for_rank(cfg, tp)
        self.num_local_kv_heads = plan.num_kv_heads  # the KV cache holds these heads
        # Built on the meta device and filled from the files: `_weight` skips nn.Embedding's random
        # init, whose normal_ on meta imports torch._dynamo (a second of every start).
        self.embed_tokens = nn.Embedding(plan.vocab_per_rank, cfg.hidden_size,
                                         _weight=torch.empty(plan.vocab_per_rank, cfg.hidden_size))
        self.layers = self._build_layers(cfg, hf_config, max_position, plan, tp)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, plan.vocab_per_rank, bias=False)

    def _build_layers(self, cfg: TransformerConfig, hf_config: dict, max_position: int, plan: ShardPlan,
                      tp: TensorParallelGroup) -> nn.ModuleList:
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        return nn.ModuleList(DecoderLayer(cfg, rotary, plan, tp, i) for i in range(cfg.num_layers))

    @classmethod
    def read_config(cls, hf_config: dict) -> TransformerConfig:
        return TransformerConfig.from_hf(hf_config, cls.__name__, attention_bias=cls.attention_bias, qk_norm=cls.qk_norm)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]

    def weight_slice(self, name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """The part of checkpoint tensor ``name`` this rank holds (see ShardPlan.weight_slice)."""
        return self.shards.weight_slice(name, shape)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings; with tensor parallelism each rank looks up the ids in its part of the
        vocabulary (zeros for the others) and the parts are summed."""
        if not self.tp.is_parallel:
            return self.embed_tokens(input_ids)
        local = input_ids - self.shards.vocab_start
        outside = (local < 0) | (local >= self.shards.vocab_rows)
        hidden = self.embed_tokens(local.masked_fill(outside, 0))
        return self.tp.all_reduce(hidden.masked_fill(outside.unsqueeze(-1), 0.0))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """``inputs_embeds``: the rows to run instead of ``embed(input_ids)`` (a prompt's image
        rows in place of its placeholder tokens' embeddings, worker/image_embeddings.py)."""
        loading = self.loading
        if loading is not None:
            loading.wait_outer()
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        stack = self.decode_stack
        if stack is not None and stack.applies(meta := get_attention_metadata()):
            residual = torch.zeros_like(hidden)
            hidden = stack(hidden, residual, positions, meta)  # every layer in one C++ call
        else:
            residual = None
            for layer in (self.layers if loading is None else loading.as_ready(self.layers)):
                hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def choose_forward(self, refused: str | None = None) -> ForwardPath:
        """Choose, once the KV cache is bound, whether decode batches take the fused C++ stack
        (models/decode_stack.py); ``refused``: why the engine's configuration keeps it off."""
        self.decode_stack, path = choose_decode_stack(self, refused)
        return path

    def decode_stack_unsupported(self) -> str | None:
        """Why this family's layers are not the fused stack's, or None (per-layer checks follow)."""
        if self.tp.is_parallel:
            return "tensor parallelism: the fused op has no all-reduce between its layers"
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied
            logits = self.backend.linear(hidden, self.embed_tokens.weight, packed_of(self.embed_tokens))
        else:
            logits = project(self.lm_head, hidden, self.backend)
        if self.tp.is_parallel:  # each rank has its part of the vocabulary (the last one padded)
            logits = self.tp.all_gather(logits, dim=-1)[..., : self.config.vocab_size]
        return logits

    # -- weights ----------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | PackedWeight]],
                     expect: Callable[[str], bool] | None = None) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the merged parameters.

        ``expect`` (progressive loading, one layer at a time): the parameters this call fills; the
        check that none is missing covers those only.

        A ``PackedWeight`` (a loader's stored quantized form) for a projection, the embedding or the
        output head that can keep it (``keeps_packed``) is set aside in ``self.packed_weights``
        (weight name → shards in order) for ``quantize_linears``; anything else is dequantized into
        the float parameter.
        """
        params = self.text_parameters()
        if expect is not None:
            params = {name: p for name, p in params.items() if expect(name)}
        loaded: set[str] = set()
        packed: dict[str, dict[int | None, PackedWeight]] = {}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding serves as the output projection
            name = name.removeprefix("model.")
            target, shard = name, None
            for fragment, (merged, index) in _STACKED.items():
                if fragment in name:
                    target, shard = name.replace(fragment, merged), index
                    break
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            loaded.add(f"{target}#{shard}")
            if isinstance(tensor, PackedWeight):
                if _may_stay_packed(target):
                    data = params[target].data
                    want = data.shape if shard is None else self._shard_view(target, data, shard).shape
                    if target in _VOCAB_PARALLEL and tuple(tensor.shape) != tuple(want):
                        self._copy_shard(params, target, shard, tensor.dequantize(), name)  # padded: float
                        continue
                    if tuple(tensor.shape) != tuple(want):
                        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(want)}")
                    packed.setdefault(target, {})[shard] = tensor
                    continue
                tensor = tensor.dequantize()
            self._copy_shard(params, target, shard, tensor, name)
        self._check_all_loaded(params, loaded)
        self.packed_weights: dict[str, list[PackedWeight]] = {}
        for target, shards in packed.items():
            ordered = [shards[i] for i in sorted(shards, key=lambda i: -1 if i is None else i)]
            if len(ordered) == max(1, _num_shards(target)) and keeps_packed(ordered, _is_projection(target)):
                self.packed_weights[target] = ordered
            else:  # e.g. Q4_0 q/k with a Q8_0 v: the merged layer stays float
                for shard, tensor in shards.items():
                    self._copy_shard(params, target, shard, tensor.dequantize(), target)

    def text_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters ``load_weights`` fills (a vision-language model loads its tower's itself)."""
        return dict(self.named_parameters())

    def _copy_shard(self, params: dict, target: str, shard: int | None, tensor: torch.Tensor, name: str) -> None:
        data = params[target].data
        if target in _VOCAB_PARALLEL and data.shape[0] > tensor.shape[0] == self.shards.vocab_rows:
            data[tensor.shape[0]:].zero_()  # the last rank's padding rows of the vocabulary
            data = data[: tensor.shape[0]]
        _copy_checked(data if shard is None else self._shard_view(target, data, shard), tensor, name)

    def _shard_view(self, target: str, data: torch.Tensor, shard: int) -> torch.Tensor:
        plan, d = self.shards, self.config.head_dim
        if ".qkv_proj." in target:
            sizes = [plan.num_heads * d, plan.num_kv_heads * d, plan.num_kv_heads * d]
        else:  # gate/up: halves (an MLP's, an expert's or a shared expert's intermediate rows)
            sizes = [data.shape[0] // 2] * 2
        return data.split(sizes, dim=0)[shard]

    def _check_all_loaded(self, params: dict, loaded: set[str]) -> None:
        missing = []
        for name in params:
            shards = _num_shards(name)
            keys = [f"{name}#{i}" for i in range(shards)] if shards else [f"{name}#None"]
            missing += [k for k in keys if k not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")


_VOCAB_PARALLEL = ("embed_tokens.weight", "lm_head.weight")


def _is_projection(target: str) -> bool:
    return target.endswith(".weight") and target.split(".")[-2] in QUANTIZED_LINEARS


def _may_stay_packed(target: str) -> bool:
    return target in ("embed_tokens.weight", "lm_head.weight") or _is_projection(target)


def _num_shards(name: str) -> int:
    """How many checkpoint tensors a merged parameter stacks (0: not merged)."""
    return 3 if ".qkv_proj." in name else 2 if ".gate_up_proj." in name else 0


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
