"""The Mamba-2 mixer (a state-space layer), as transformers' ``Mamba2Mixer`` / ``BambaMixer``
compute it, over the engine's per-request state slots instead of a cache per batch.

in_proj gives the gate z, the convolution's input xBC and the time step dt; xBC goes through a
depthwise causal convolution (kernel K, SiLU) and splits into x (heads x head_dim), B and C (n_groups
x state); the selective scan (layers/ssd_scan.py) maps x to y with the state; y is gated by
SiLU(z), normalized per group, and projected out. A request's recurrent state is what the layer
keeps between steps: the last K - 1 convolution inputs and the scan's [heads, head_dim, state]
matrix, in slot ``s`` of the layer's state tensors (``bind_state``), where ``s`` is the request's
slot for the whole time it runs (forward_context.StateMetadata). The state does not grow with
the context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagoda.forward_context import StateMetadata, get_attention_metadata
from pagoda.layers.backend import current_backend
from pagoda.layers.linear import project
from pagoda.layers.ssd_scan import causal_conv, chunked_scan, conv_step, discretize, heads_of_groups, recurrent_step


@dataclass(frozen=True)
class MambaConfig:
    """A Mamba-2 mixer's shape, from a config.json (Mamba2's names or the hybrids' ``mamba_*``)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    intermediate_size: int
    use_bias: bool
    use_conv_bias: bool
    chunk_size: int
    time_step_limit: tuple[float, float]
    norm_eps: float

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @classmethod
    def from_hf(cls, hf: dict, prefix: str = "") -> MambaConfig:
        """``prefix``: "" for Mamba2's names (num_heads, state_size, ...), "mamba_" for a hybrid's
        (mamba_n_heads, mamba_d_state, ...)."""
        if hf.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"Mamba-2 with hidden_act={hf.get('hidden_act')!r} is not supported (silu)")
        hidden = hf["hidden_size"]
        if prefix:
            names = dict(num_heads="mamba_n_heads", head_dim="mamba_d_head", state_size="mamba_d_state",
                         n_groups="mamba_n_groups", conv_kernel="mamba_d_conv", expand="mamba_expand",
                         use_bias="mamba_proj_bias", use_conv_bias="mamba_conv_bias", chunk_size="mamba_chunk_size",
                         eps="rms_norm_eps")
        else:
            names = dict(num_heads="num_heads", head_dim="head_dim", state_size="state_size", n_groups="n_groups",
                         conv_kernel="conv_kernel", expand="expand", use_bias="use_bias",
                         use_conv_bias="use_conv_bias", chunk_size="chunk_size", eps="layer_norm_epsilon")
        intermediate = int(hf.get(names["expand"], 2) * hidden)
        num_heads = int(hf[names["num_heads"]])
        head_dim = hf.get(names["head_dim"], "auto")
        head_dim = intermediate // num_heads if head_dim in (None, "auto") else int(head_dim)
        if head_dim * num_heads != intermediate:
            raise ValueError(f"Mamba-2: {num_heads} heads of {head_dim} do not make the inner size {intermediate}")
        limit = hf.get("time_step_limit") or (0.0, float("inf"))
        return cls(hidden, num_heads, head_dim, int(hf.get(names["state_size"], 128)), int(hf.get(names["n_groups"], 1)),
                   int(hf.get(names["conv_kernel"], 4)), intermediate, bool(hf.get(names["use_bias"], False)),
                   bool(hf.get(names["use_conv_bias"], True)), int(hf.get(names["chunk_size"], 256)),
                   (_number(limit[0]), _number(limit[1])), float(hf.get(names["eps"], 1e-5)))


def _number(value) -> float:
    """A config.json float; transformers 5 writes infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


class GatedRMSNorm(nn.Module):
    """transformers' MambaRMSNormGated: y * SiLU(z), RMS-normalized within each of ``groups``
    groups, times the weight (in fp32, the weight applied in the gate's dtype)."""

    def __init__(self, size: int, groups: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.groups, self.eps = groups, eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = y * torch.nn.functional.silu(gate.float())
        grouped = y.view(y.shape[0], self.groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * grouped.view_as(y).to(gate.dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: MambaConfig) -> None:
        super().__init__()
        self.cfg, self.backend = cfg, current_backend()
        self.in_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size + cfg.conv_dim + cfg.num_heads,
                                 bias=cfg.use_bias)
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.conv_kernel, groups=cfg.conv_dim,
                                bias=cfg.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(cfg.num_heads))
        self.A_log = nn.Parameter(torch.empty(cfg.num_heads))
        self.D = nn.Parameter(torch.empty(cfg.num_heads))
        self.norm = GatedRMSNorm(cfg.intermediate_size, cfg.n_groups, cfg.norm_eps)
        self.out_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.use_bias)
        self.conv_state: torch.Tensor | None = None  # [slots, conv_dim, K - 1]
        self.ssm_state: torch.Tensor | None = None  # [slots, heads, head_dim, state]

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One slot's convolution state and scan state."""
        c = self.cfg
        return (c.conv_dim, c.conv_kernel - 1), (c.num_heads, c.head_dim, c.state_size)

    def bind_state(self, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> None:
        """This layer's state tensors, a slot per running request (worker/state_cache.py)."""
        self.conv_state, self.ssm_state = conv_state, ssm_state

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        states = get_attention_metadata().states
        projected = project(self.in_proj, hidden, self.backend)
        gate, xbc, dt = projected.split([c.intermediate_size, c.conv_dim, c.num_heads], dim=-1)
        y = torch.empty(hidden.shape[0], c.num_heads, c.head_dim, dtype=torch.float32, device=hidden.device)
        self._decodes(states, xbc, dt, y)
        for start, count, slot, fresh, saves in states.chunks:
            rows = slice(start, start + count)
            y[rows] = self._chunk(slot, fresh, xbc[rows], dt[rows], saves)
        y = self.norm(y.view(hidden.shape[0], -1), gate)
        return project(self.out_proj, y.to(hidden.dtype), self.backend)

    def _decodes(self, states: StateMetadata, xbc: torch.Tensor, dt: torch.Tensor, y: torch.Tensor) -> None:
        """Every one-token sequence at once: gather its slots, step, scatter back."""
        if not len(states.decode_tokens):
            return
        c, rows, slots = self.cfg, states.decode_tokens, states.decode_slots
        conv, ssm = self.conv_state[slots], self.ssm_state[slots]  # copies: stepped in place
        if states.decode_fresh.any():  # a fresh sequence's slot holds another's state
            conv[states.decode_fresh], ssm[states.decode_fresh] = 0.0, 0.0
        conv_out, conv = conv_step(xbc[rows].float(), conv, self.conv1d.weight.squeeze(1).float(), self._conv_bias())
        x, B, C = self._split(conv_out)
        out, ssm = recurrent_step(ssm, x, discretize(dt[rows], self.dt_bias, c.time_step_limit), self._A(), B, C,
                                  self.D.float())
        self.conv_state.index_copy_(0, slots, conv)
        self.ssm_state.index_copy_(0, slots, ssm)
        y[rows] = out
        for slot, snapshot in states.decode_saves:
            self.conv_state[snapshot], self.ssm_state[snapshot] = self.conv_state[slot], self.ssm_state[slot]

    def _chunk(self, slot: int, fresh: bool, xbc: torch.Tensor, dt: torch.Tensor,
               saves: list[tuple[int, int]]) -> torch.Tensor:
        """One sequence's chunk of several tokens, from its slot's state (zeros when fresh); the
        state after the first k tokens goes to snapshot slot s for each (k, s) of ``saves`` (the
        chunk runs in pieces split there: the scan is exact at any split)."""
        c = self.cfg
        conv, ssm = self.conv_state[slot].float(), self.ssm_state[slot].float()
        if fresh:
            conv, ssm = torch.zeros_like(conv), torch.zeros_like(ssm)
        weight, bias, A, D = self.conv1d.weight.squeeze(1).float(), self._conv_bias(), self._A(), self.D.float()
        dt = discretize(dt, self.dt_bias, c.time_step_limit)
        outs, begin = [], 0
        for end, snapshot in [*saves, (xbc.shape[0], slot)]:
            if end > begin:
                conv_out, conv = causal_conv(xbc[begin:end].float(), conv, weight, bias)
                x, B, C = self._split(conv_out)
                out, ssm = chunked_scan(ssm, x, dt[begin:end], A, B, C, D, c.chunk_size)
                outs.append(out)
            self.conv_state[snapshot] = conv.to(self.conv_state.dtype)
            self.ssm_state[snapshot] = ssm.to(self.ssm_state.dtype)
            begin = end
        return torch.cat(outs)

    def _split(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[n, conv_dim] → x [n, H, P], B and C [n, H, N] (each head its group's)."""
        c = self.cfg
        group_size = c.n_groups * c.state_size
        x, B, C = conv_out.split([c.intermediate_size, group_size, group_size], dim=-1)
        n = conv_out.shape[0]
        B = heads_of_groups(B.reshape(n, c.n_groups, c.state_size), c.num_heads)
        C = heads_of_groups(C.reshape(n, c.n_groups, c.state_size), c.num_heads)
        return x.reshape(n, c.num_heads, c.head_dim), B, C

    def _A(self) -> torch.Tensor:
        return -torch.exp(self.A_log.float())

    def _conv_bias(self) -> torch.Tensor | None:
        return self.conv1d.bias.float() if self.conv1d.bias is not None else None