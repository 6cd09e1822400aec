"""The Mamba-2 scan's two forms agree: the chunked SSD form over a prompt (any chunk size, split
anywhere and continued from the state it left) equals the recurrent step taken token by token,
and so does the causal convolution with its window."""

from __future__ import annotations

import pytest
import torch

from pagoda.layers.ssd_scan import causal_conv, chunked_scan, conv_step, discretize, heads_of_groups, recurrent_step

T, H, P, N, G, CONV, K = 23, 4, 3, 5, 2, 6, 4


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, P, generator=g)
    dt = discretize(torch.randn(T, H, generator=g), torch.randn(H, generator=g), (0.0, float("inf")))
    A = -torch.rand(H, generator=g) * 2
    B = heads_of_groups(torch.randn(T, G, N, generator=g), H)
    C = heads_of_groups(torch.randn(T, G, N, generator=g), H)
    return torch.randn(H, P, N, generator=g), x, dt, A, B, C, torch.randn(H, generator=g)


def _step_by_step(state, x, dt, A, B, C, D):
    state, ys = state.clone(), []  # (recurrent_step updates its state in place)
    for t in range(x.shape[0]):
        y, state = recurrent_step(state[None], x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], D)
        state = state[0]
        ys.append(y[0])
    return torch.stack(ys), state


@pytest.mark.parametrize("chunk_size", [1, 4, 8, 64])
def test_chunked_form_equals_the_recurrence(chunk_size):
    state, x, dt, A, B, C, D = _inputs()
    want_y, want_state = _step_by_step(state, x, dt, A, B, C, D)
    y, final = chunked_scan(state, x, dt, A, B, C, D, chunk_size)
    torch.testing.assert_close(y, want_y, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(final, want_state, rtol=1e-4, atol=1e-5)


def test_a_prompt_split_anywhere_continues_from_its_state():
    state, x, dt, A, B, C, D = _inputs(1)
    whole, final = chunked_scan(state, x, dt, A, B, C, D, 8)
    first, mid = chunked_scan(state, x[:10], dt[:10], A, B[:10], C[:10], D, 8)
    rest, end = chunked_scan(mid, x[10:], dt[10:], A, B[10:], C[10:], D, 8)
    torch.testing.assert_close(torch.cat([first, rest]), whole, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(end, final, rtol=1e-4, atol=1e-5)


def test_convolution_window_carries_across_calls():
    g = torch.Generator().manual_seed(2)
    x, weight, bias = torch.randn(T, CONV, generator=g), torch.randn(CONV, K, generator=g), torch.randn(CONV, generator=g)
    zero = torch.zeros(CONV, K - 1)
    whole, window = causal_conv(x, zero, weight, bias)
    head, mid = causal_conv(x[:9], zero, weight, bias)
    ys, state = [head], mid[None]
    for t in range(9, T):
        y, state = conv_step(x[t : t + 1], state, weight, bias)
        ys.append(y)
    torch.testing.assert_close(torch.cat(ys), whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state[0], window)


def test_decays_past_the_floor_are_exact_zeros_and_both_forms_still_agree():
    """Fast-decaying heads (A of -40: a factor of e^-52 a token, as a random Bamba's last heads
    reach) make no denormal products, and the chunked form still equals the recurrence."""
    from pagoda.layers.ssd_scan import LOG_DECAY_FLOOR, decay

    assert decay(torch.tensor([LOG_DECAY_FLOOR - 1, -10.0])).tolist() == [0.0, pytest.approx(4.54e-5, rel=1e-3)]
    state, x, dt, _, B, C, D = _inputs(3)
    A = torch.tensor([-40.0, -1.0, -40.0, -0.5])
    want_y, want_state = _step_by_step(state, x, dt + 1.0, A, B, C, D)
    y, final = chunked_scan(state, x, dt + 1.0, A, B, C, D, 8)
    torch.testing.assert_close(y, want_y, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(final, want_state, rtol=1e-4, atol=1e-5)
    tiny = torch.finfo(torch.float32).tiny
    assert not ((final.abs() < tiny) & (final != 0)).any()
