"""A LoRA delta is added to exactly its adapter's rows, over any base projection: float, bf16,
and the int8 / int4 block layers of quantized bases, with an adapter's rows in one run or several."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagoda.forward_context import AttentionMetadata, set_attention_metadata
from pagoda.layers.backend import TorchBackend, current_backend
from pagoda.layers.linear import project
from pagoda.layers.lora_delta import DeltaPart, LoRABatch, ProjectionDelta, runs_of
from pagoda.layers.quantization import quantize_linears
from pagoda.lora.binding import label_projections

IN, OUT, RANK, ROWS = 64, 96, 4, 7


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = nn.Linear(IN, OUT, bias=False)


def _delta(seed: int) -> tuple[ProjectionDelta, torch.Tensor, list[torch.Tensor]]:
    """A delta of two parts (columns [0, 32) and [32, 96)), and its dense [IN, OUT] equivalent."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(2 * RANK, IN, generator=g) * 0.1
    b1, b2 = torch.randn(32, RANK, generator=g) * 0.1, torch.randn(OUT - 32, RANK, generator=g) * 0.1
    dense = torch.cat([(b1 @ a[:RANK]).t(), (b2 @ a[RANK:]).t()], dim=1)
    return ProjectionDelta(a, (DeltaPart(0, 32, 0, RANK, b1.t().contiguous()),
                               DeltaPart(32, OUT - 32, RANK, 2 * RANK, b2.t().contiguous()))), dense


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "torch"])
@pytest.mark.parametrize("base", ["float32", "bfloat16", "int8", "int4"])
def test_delta_lands_on_its_rows_only(base, kernels):
    torch.manual_seed(0)
    model = _Layer()
    nn.init.normal_(model.qkv_proj.weight, std=0.1)
    if base == "bfloat16":
        model = model.to(torch.bfloat16)
    elif base in ("int8", "int4"):
        assert quantize_linears(model, base) == 1
    label_projections(model)
    layer, backend = model.qkv_proj, current_backend() if kernels else TorchBackend("cpu")
    if kernels and not backend.has_cpu_kernels:
        pytest.skip("pagoda's CPU kernels are not built here")
    x = torch.randn(ROWS, IN).to(torch.bfloat16 if base == "bfloat16" else torch.float32)
    (first, dense_a), (second, dense_b) = _delta(1), _delta(2)
    adapters = torch.tensor([1, 1, 0, 2, 1, 2, 0]).numpy()  # each token's adapter (0: the base)
    meta = AttentionMetadata(slot_mapping=torch.zeros(ROWS, dtype=torch.long))
    with set_attention_metadata(meta):
        plain = project(layer, x, backend).float()
        meta.lora = LoRABatch({1: {"qkv_proj": first}, 2: {"qkv_proj": second}}, adapters)
        adapted = project(layer, x, backend).float()
    want = plain.clone()
    want[adapters == 1] += x.float()[adapters == 1] @ dense_a
    want[adapters == 2] += x.float()[adapters == 2] @ dense_b
    tolerance = 2e-2 if base == "bfloat16" else 1e-5
    torch.testing.assert_close(adapted, want, atol=tolerance, rtol=tolerance)
    assert torch.equal(adapted[adapters == 0], plain[adapters == 0])  # the base rows are untouched


def test_runs_of_an_adapters_rows():
    ids = torch.tensor([0, 3, 3, 3, 0, 5, 3]).numpy()
    assert runs_of(ids, 3) == [slice(1, 4), slice(6, 7)]
    assert runs_of(ids, 5) == [slice(5, 6)]
