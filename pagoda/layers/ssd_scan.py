"""The Mamba-2 selective scan in plain torch: the recurrent step for decode rows, and the chunked
form of state space duality (SSD) for prompt chunks, both in fp32.

Per head h, with a_t = dt_t * A_h (a log decay, <= 0), the state h_t [P, N] and the input
u_t = dt_t * x_t [P]:

    h_t = exp(a_t) h_{t-1} + u_t B_t^T          y_t = h_t C_t + D_h x_t

Over a chunk of L tokens with S_t = a_0 + ... + a_t (inclusive), the recurrence unrolls to

    h_t = exp(S_t) h_init + sum_{s <= t} exp(S_t - S_s) u_s B_s^T
    y_t = exp(S_t) h_init C_t + sum_{s <= t} exp(S_t - S_s) (C_t . B_s) u_s + D_h x_t

an L x L masked "attention" per head plus the initial state's contribution: matmuls instead of L
dependent steps, what the Mamba-2 paper calls the SSD chunked form. Chunks run one after another,
each starting from the last one's final state, so a prompt's state after any prefix is exact, and
a prompt split over several engine steps (chunked prefill) continues from the stored state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Decay factors below e^-46 (~1e-20) are taken as 0. What they would keep of a state is more than
# 13 orders of magnitude under fp32's resolution of anything it is added to, and their products
# land in the denormal range, which x86 computes ~100x slower: a random-weight Bamba's decode step
# took 5.7x longer with them (benchmarks/README.md, "State-space decode ITL against context").
LOG_DECAY_FLOOR = -46.0


def decay(log: torch.Tensor) -> torch.Tensor:
    """exp(log), exactly 0 where ``log`` is under ``LOG_DECAY_FLOOR``."""
    return torch.exp(log.masked_fill(log < LOG_DECAY_FLOOR, float("-inf")))


def discretize(dt: torch.Tensor, dt_bias: torch.Tensor, limit: tuple[float, float]) -> torch.Tensor:
    """softplus(dt + dt_bias), clamped to the config's ``time_step_limit`` (fp32, [T, H])."""
    dt = F.softplus(dt.float() + dt_bias.float())
    low, high = limit
    if low > 0.0 or high != float("inf"):
        dt = dt.clamp(min=low, max=high)
    return dt


def heads_of_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[T, G, N] → [T, H, N]: head h reads group h // (H / G), as transformers' repeat_interleave."""
    return t.repeat_interleave(num_heads // t.shape[1], dim=1)


def recurrent_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of n sequences: state [n, H, P, N], x [n, H, P], dt [n, H] (discretized),
    A [H], B / C [n, H, N], D [H] → (y [n, H, P], the new state, ``state`` updated in place)."""
    u = dt.unsqueeze(-1) * x  # [n, H, P]
    state.mul_(decay(dt * A)[:, :, None, None]).add_(u.unsqueeze(-1) * B.unsqueeze(2))
    y = torch.einsum("nhpk,nhk->nhp", state, C) + D[:, None] * x
    return y, state


def chunked_scan(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                 C: torch.Tensor, D: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's T tokens: state [H, P, N] (its state before them), x [T, H, P], dt [T, H]
    (discretized), A [H], B / C [T, H, N], D [H] → (y [T, H, P], the state after the last token)."""
    ys = []
    for begin in range(0, x.shape[0], chunk_size):
        end = begin + chunk_size
        y, state = _chunk(state, x[begin:end], dt[begin:end], A, B[begin:end], C[begin:end])
        ys.append(y)
    return torch.cat(ys) + D[:, None] * x, state


def _chunk(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
           C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD form over one chunk of L tokens, without the D skip (see the module docstring)."""
    a = (dt * A).transpose(0, 1)  # [H, L]
    S = torch.cumsum(a, dim=-1)  # [H, L], inclusive
    length = x.shape[0]
    # exp(S_t - S_s) for s <= t, 0 above the diagonal (masked before exp: above it the
    # difference is positive and could overflow)
    causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
    segments = S.unsqueeze(-1) - S.unsqueeze(-2)  # [H, t, s]
    u = dt.unsqueeze(-1) * x  # [L, H, P]
    scores = torch.einsum("thn,shn->hts", C, B) * decay(segments.masked_fill(~causal, float("-inf")))  # [H, t, s]
    y = torch.einsum("hts,shp->thp", scores, u)
    into = decay(S).transpose(0, 1)  # [L, H]: the initial state's decay up to t
    y = y + torch.einsum("hpn,thn->thp", state, C) * into[:, :, None]
    to_end = decay(S[:, -1:] - S).transpose(0, 1)  # [L, H]: decay from s to the chunk's end
    state = state * decay(S[:, -1])[:, None, None] + torch.einsum("sh,shp,shn->hpn", to_end, u, B)
    return y, state


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The depthwise causal convolution and SiLU of one sequence's T tokens: x [T, C], state
    [C, K - 1] (the K - 1 inputs before them, zeros for a fresh sequence), weight [C, K] →
    (y [T, C], the state after them)."""
    kernel = weight.shape[-1]
    full = torch.cat([state.to(x.dtype), x.transpose(0, 1)], dim=-1)  # [C, K - 1 + T]
    y = F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), bias, groups=weight.shape[0])[0]
    return F.silu(y).transpose(0, 1), full[:, full.shape[-1] - (kernel - 1):]


def conv_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``causal_conv`` for one token of each of n sequences: x [n, C], state [n, C, K - 1]."""
    full = torch.cat([state.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [n, C, K]
    y = (full * weight).sum(-1)
    if bias is not None:
        y = y + bias
    return F.silu(y), full[:, :, 1:]
