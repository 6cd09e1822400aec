"""The super-block formats (Q4_K, Q5_K, Q6_K, IQ4_XS, IQ4_NL, and the blocks of 32 Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0 a file mixes with them) repacked into tiles: the tiles hold
the file's weights exactly, the GEMM is the reference arithmetic (int8 activations per block of
32, exact weights) at every row count, a row's result does not depend on the rows beside it or on
the other parts of a merged weight, and bad input is refused with a message naming it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from superblock_data import TYPE_IDS, TYPES, dequantized, int8_reference, kernel_cases, random_blocks

from pagoda.layers import superblocks
from pagoda.layers.backend import select_backend
from pagoda.layers.cpu_kernels import load_cpu_kernels

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="pagoda's C++ kernels cannot be built here")


@pytest.fixture(scope="module")
def ops():
    return load_cpu_kernels()


def _gemm(ops, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return ops.superblock_gemm(x, packed, superblocks.header(packed)[1])


def _packed(ops, blocks: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    return ops.superblock_repack([blocks], [TYPE_IDS[qtype]], k)


@pytest.mark.parametrize("qtype", TYPES)
def test_tiles_hold_the_files_weights_exactly(ops, qtype):
    rng = np.random.default_rng(1)
    for n, k in ((37, 512), (16, 256)):
        blocks = random_blocks(qtype, n, k, rng)
        packed = _packed(ops, torch.from_numpy(blocks), qtype, k)
        assert superblocks.header(packed) == (k, n, [(TYPE_IDS[qtype], n)])
        rows = ops.superblock_rows(packed, torch.arange(n))
        assert torch.equal(rows, torch.from_numpy(dequantized(blocks, qtype, k))), (qtype, n, k)
        # the bytes take the file's size to within the 2 % of the tiles' scale layout (and padding rows)
        file_bytes = blocks.nbytes * ((n + 15) // 16 * 16) / n
        assert packed.numel() - 256 <= 1.03 * file_bytes


@pytest.fixture
def batch_invariant():
    """Deterministic inference: every row count on the integer kernels (outside it, many rows may
    take the bf16 route, tested on its own below)."""
    with select_backend("cpu").batch_invariant(True):
        yield


def test_gemm_is_the_reference_arithmetic_at_every_row_count(ops, batch_invariant):
    for qtype, x, blocks in kernel_cases():
        k = x.shape[1]
        weight = torch.from_numpy(dequantized(blocks.numpy(), qtype, k))
        got = _gemm(ops, x, _packed(ops, blocks, qtype, k))
        torch.testing.assert_close(got, int8_reference(x, weight), rtol=1e-5, atol=1e-4, msg=f"{qtype} M={x.shape[0]}")


def test_block_matmul_takes_a_packed_weight(ops):
    qtype, x, blocks = kernel_cases()[3]
    packed = _packed(ops, blocks, qtype, x.shape[1])
    assert torch.equal(ops.block_matmul(x, packed, superblocks.PACKED), _gemm(ops, x, packed))


def test_a_rows_result_depends_on_no_other_row_or_part(ops, batch_invariant):
    """Batch invariance (a row's bits are the same alone or in a batch of 70), and a merged weight of
    parts in three types gives each part's own results."""
    rng = np.random.default_rng(2)
    g = torch.Generator().manual_seed(2)
    parts = [("Q4_K", 32), ("Q6_K", 16), ("Q4_K", 21), ("IQ4_XS", 5), ("Q5_0", 16), ("Q8_0", 3)]
    blocks = [torch.from_numpy(random_blocks(q, n, 256, rng)) for q, n in parts]
    merged = ops.superblock_repack(blocks, [TYPE_IDS[q] for q, _ in parts], 256)
    x = torch.randn(70, 256, generator=g)
    together = _gemm(ops, x, merged)
    alone = torch.cat([_gemm(ops, x, _packed(ops, b, q, 256)) for b, (q, _) in zip(blocks, parts)], dim=1)
    assert torch.equal(together, alone)
    for i in (0, 5, 69):
        assert torch.equal(_gemm(ops, x[i:i + 1], merged), together[i:i + 1])
    rows = ops.superblock_rows(merged, torch.tensor([0, 40, 69, 73, 80, 92]))
    weights = torch.cat([torch.from_numpy(dequantized(b.numpy(), q, 256)) for b, (q, _) in zip(blocks, parts)])
    assert torch.equal(rows, weights[[0, 40, 69, 73, 80, 92]])


@pytest.mark.skipif(not (load_cpu_kernels() and load_cpu_kernels().superblock_bf16_rows()),
                    reason="no bf16 route here (it needs AMX-BF16)")
@pytest.mark.parametrize("qtype", TYPES)
def test_many_rows_take_the_bf16_route_outside_deterministic_inference(ops, qtype):
    """From superblock_bf16_rows() rows, outside deterministic inference: the bf16 GEMM of the
    activations and the file's weights each rounded to bf16 (fp32 sums); below it, and under batch
    invariance at any count, the integer kernels' rows, as a row alone gives them."""
    rng = np.random.default_rng(4)
    g = torch.Generator().manual_seed(4)
    blocks = torch.from_numpy(random_blocks(qtype, 37, 512, rng))
    packed, weight = _packed(ops, blocks, qtype, 512), torch.from_numpy(dequantized(blocks.numpy(), qtype, 512))
    first = ops.superblock_bf16_rows()
    for m in (first, first + 1, 70, 300):  # one row chunk, a ragged one, several work items
        x = torch.randn(m, 512, generator=g)
        bf16 = (x.bfloat16().double() @ weight.bfloat16().double().T)
        got = _gemm(ops, x, packed)
        assert ((got.double() - bf16).abs().max() / bf16.abs().max()).item() < 1e-5, (qtype, m)
        alone = torch.cat([_gemm(ops, x[i:i + 1], packed) for i in range(m)])
        with select_backend("cpu").batch_invariant(True):
            assert torch.equal(_gemm(ops, x, packed), alone), (qtype, m)
    x = torch.randn(first - 1, 512, generator=g)
    assert torch.equal(_gemm(ops, x, packed), torch.cat([_gemm(ops, x[i:i + 1], packed) for i in range(first - 1)]))


def test_fused_down_projection_is_silu_and_mul_then_the_gemm(ops):
    for qtype, x, blocks in kernel_cases()[::4]:
        gate_up = torch.cat([x, x.flip(1)], 1)
        packed = _packed(ops, blocks, qtype, x.shape[1])
        fused = ops.silu_mul_superblock_gemm(gate_up, packed)
        assert torch.equal(fused, _gemm(ops, ops.silu_and_mul(gate_up), packed)), qtype


def test_bad_input_is_refused_with_a_message_naming_it(ops):
    rng = np.random.default_rng(3)
    blocks = torch.from_numpy(random_blocks("Q4_K", 4, 256, rng))
    with pytest.raises(RuntimeError, match=r"part 0 is not \[rows, 144\] bytes of Q4_K"):
        ops.superblock_repack([blocks[:, :100]], [12], 256)
    with pytest.raises(RuntimeError, match="type 9 is not Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL or IQ4_XS"):
        ops.superblock_repack([blocks], [9], 256)
    with pytest.raises(RuntimeError, match="100 inputs are not whole Q4_K super-blocks of 256"):
        ops.superblock_repack([blocks], [12], 100)
    packed = ops.superblock_repack([blocks], [12], 256)
    with pytest.raises(RuntimeError, match="x has 512 features, the weight takes 256"):
        _gemm(ops, torch.zeros(1, 512), packed)
    with pytest.raises(RuntimeError, match="the weight has 4 outputs, not 5"):
        ops.superblock_gemm(torch.zeros(1, 256), packed, 5)
    with pytest.raises(RuntimeError, match="not a packed weight"):
        ops.superblock_gemm(torch.zeros(1, 256), torch.zeros(300, dtype=torch.uint8), 4)
    with pytest.raises(RuntimeError, match="row 4 is out of range for 4 rows"):
        ops.superblock_rows(packed, torch.tensor([4]))
