"""The fused float32 CPU ops (pagoda/csrc/fused_ops.cpp) against the pure-torch code they replace,
op by op and through the whole engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda import LLM, SamplingParams
from pagoda.layers.backend import TorchBackend, select_backend
from pagoda.layers.cpu_kernels import load_cpu_kernels
from pagoda.layers.norm import RMSNorm
from pagoda.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="pagoda's C++ kernels cannot be built here")


def test_fused_add_rms_norm():
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = torch.randn(96)
    x, residual = torch.randn(7, 96), torch.randn(7, 96)
    got_x, got_r = norm(x.clone(), residual.clone())
    norm.backend = TorchBackend()
    want_x, want_r = norm(x, residual)
    assert torch.equal(got_r, want_r)  # the same one addition
    torch.testing.assert_close(got_x, want_x, rtol=1e-6, atol=1e-6)  # sums of squares in another order


def test_rotary_in_place_on_strided_rows():
    rotary = RotaryEmbedding(32, 64, 10000.0)
    qkv = torch.randn(5, 4 * 32 + 2 * 2 * 32)
    q, k, _ = qkv.split([128, 64, 64], dim=-1)  # views with a row stride, as the model has them
    q, k = q.view(5, 4, 32), k.view(5, 2, 32)
    positions = torch.tensor([0, 3, 9, 10, 63])
    kernels, rotary.backend = rotary.backend, TorchBackend()
    want = rotary(positions, q.clone(), k.clone())
    rotary.backend = kernels
    got = rotary(positions, q, k)
    assert got[0].data_ptr() == q.data_ptr()  # in place
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])  # the same roundings
    with pytest.raises(RuntimeError, match="position 64 out of range"):
        rotary(torch.tensor([0, 1, 2, 3, 64]), q, k)


@pytest.mark.parametrize("width", [48, 51])  # 8-lane vectors only, and a scalar tail
def test_silu_and_mul(width):
    x = torch.randn(6, 2 * width) * 4
    x[0, :4] = torch.tensor([-100.0, 100.0, -87.5, 0.0])  # where exp is clamped, and zero
    gate, up = x.split(width, dim=-1)
    torch.testing.assert_close(load_cpu_kernels().silu_and_mul(x), F.silu(gate) * up, rtol=1e-6, atol=1e-6)


def test_argmax_rows_as_torch():
    """The first of equal maxima, a NaN as the largest, rows of -inf, vector-width tails, strided input."""
    ops = load_cpu_kernels()
    x = torch.randn(6, 1003)
    x[0, 5] = x[0, 900] = 100.0  # a tie: the first wins
    x[1, 3] = x[1, 700] = float("nan")
    x[2] = float("-inf")
    x[3, 1002] = float("inf")  # in the scalar tail
    x[4, 17] = x[4, 1001] = 50.0
    for t in (x, torch.randn(2000, 8).t(), torch.randn(64, 49152), torch.randn(3, 7)):
        assert torch.equal(ops.argmax_rows(t), t.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="argmax_rows"):
        ops.argmax_rows(torch.randn(3, 4).double())


def test_write_kv_cache():
    k_cache, v_cache = torch.zeros(4, 2, 8, 16), torch.zeros(4, 2, 8, 16)
    kv = torch.randn(3, 2 * 2 * 16)
    k, v = (t.view(3, 2, 16) for t in kv.split(32, dim=-1))
    slots = torch.tensor([0, 13, 31])
    load_cpu_kernels().write_kv_cache(k, v, k_cache, v_cache, slots)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    want_k[slots // 8, :, slots % 8] = k
    want_v[slots // 8, :, slots % 8] = v
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    with pytest.raises(RuntimeError, match="slot 32 out of range"):
        load_cpu_kernels().write_kv_cache(k, v, k_cache, v_cache, torch.tensor([0, 1, 32]))


def test_engine_tokens_equal_the_pure_torch_path(tiny_llama, torch_kernels_only):
    """Greedy tokens and logprobs of a batch, fused CPU path vs every layer in plain torch."""
    from pagoda.layers import cpu_kernels

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    prompts = ["The quick brown fox", "Paris is the capital of", "Once upon a time"]

    def run():
        llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory=0.02)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return ([list(o.outputs[0].token_ids) for o in outs],
                [[pos[t].logprob for t, pos in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs])

    plain_tokens, plain_lps = run()  # PAGODA_DISABLE_KERNELS=1 (the fixture)
    cpu_kernels._disabled = False
    fused_tokens, fused_lps = run()
    assert fused_tokens == plain_tokens
    torch.testing.assert_close(torch.tensor(fused_lps), torch.tensor(plain_lps), rtol=0, atol=1e-4)


@pytest.mark.parametrize("m", [1, 3, 4, 9, 32, 33])
def test_small_m_linear_is_the_float_product(m):
    """pagoda::linear: its own kernel up to 32 rows (sums in another order than MKL's), at::linear beyond."""
    linear = select_backend("cpu").linear
    w = torch.randn(70, 100)  # K not a multiple of 8: the scalar tail
    x = torch.randn(m, 100)
    torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    rows = torch.cat([linear(x[i : i + 1], w) for i in range(m)])
    if m <= 32:
        assert torch.equal(linear(x, w), rows)  # each row computed alone, whatever the batch
    assert torch.equal(linear(x.double(), w.double()), F.linear(x.double(), w.double()))  # other dtypes: torch
