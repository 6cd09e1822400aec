"""Weight-only int8 / int4 linear layers on torch's own CPU kernels: the fallback where pagoda's
compiled kernels do not load (quantization.py chooses).

- ``Int8Linear``: symmetric per-output-channel int8, ``w = q * scale``, q in [-128, 127]; the matmul
  is ``aten._weight_int8pack_mm``. ``Int8Embedding``: the same rows as an embedding table (a tied
  output head shares them).
- ``Int4Linear``: asymmetric group-wise int4 (groups of ``INT4_GROUP_SIZE`` along the input
  dimension), ``w = (q - 8) * scale + zero``, q in [0, 15]; the weight is packed by
  ``aten._convert_weight_to_int4pack_for_cpu`` and the matmul is ``aten._weight_int4pack_mm_for_cpu``.

The kernels' activation dtype (``compute_dtype``) is bf16: on this kind of CPU (AVX2, no AMX) their
fp32 and fp16 paths run 10-60x slower than an fp32 ``nn.Linear``, while the bf16 path beats it at
batch 1 (benchmarks/README.md). A layer therefore casts its input to bf16 and its output back to the
model's dtype; the scales live in bf16 too, as the kernels require. With ``compute_dtype=float32``
the same layers compute exactly with the stored values (slowly), which is how the tests check that
a repacked GGUF weight is the dequantized weight bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

INT4_GROUP_SIZE = 32
COMPUTE_DTYPE = torch.bfloat16  # the kernels' only fast activation dtype on CPU


def _matmul_input(x: torch.Tensor, in_features: int, compute_dtype: torch.dtype) -> torch.Tensor:
    return x.reshape(-1, in_features).to(compute_dtype)


def _finish(y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = y.to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


class Int8Linear(nn.Module):
    """``y = x @ (q * scale).T + bias`` with ``aten._weight_int8pack_mm``."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("bias", bias)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.scales.dtype

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   compute_dtype: torch.dtype = COMPUTE_DTYPE) -> Int8Linear:
        w = weight.detach().float()
        # Round the scale to the kernel's dtype first, then the codes against it: the layer
        # computes with exactly q * scale, no second rounding of the scale.
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8).to(compute_dtype)
        q = torch.round(w / scales.float()[:, None]).clamp_(-128, 127).to(torch.int8)
        return cls(q, scales, None if bias is None else bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(_matmul_input(x, self.in_features, self.compute_dtype),
                                               self.qweight, self.scales)
        return _finish(y, x, self.bias)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight this layer multiplies by."""
        return self.qweight.float() * self.scales.float()[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel, {self.compute_dtype}"


class Int8Embedding(nn.Module):
    """An embedding table stored as int8 rows with one scale per row (the layout of an Int8Linear
    over the same table, so a tied output head shares the tensors)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = qweight.shape
        self.dtype = dtype
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight[ids].to(self.dtype) * self.scales[ids].to(self.dtype).unsqueeze(-1)


class Int4Linear(nn.Module):
    """``y = x @ W.T + bias`` with W int4 in groups: ``w = (q - 8) * scale + zero``,
    via ``aten._weight_int4pack_mm_for_cpu``."""

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features = packed.shape[0]
        self.in_features = packed.shape[1] * 2
        self.group_size = group_size
        self.register_buffer("qweight", packed)  # uint8 [N, K/2], the kernel's own layout
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # [K/G, N, 2]
        self.register_buffer("bias", bias)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.scales_and_zeros.dtype

    @staticmethod
    def supports(out_features: int, in_features: int, group_size: int = INT4_GROUP_SIZE) -> bool:
        """Shapes the CPU packing accepts: N a multiple of 16, K of the group size."""
        return out_features % 16 == 0 and in_features % group_size == 0

    @classmethod
    def from_groups(cls, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    bias: torch.Tensor | None = None, group_size: int = INT4_GROUP_SIZE,
                    compute_dtype: torch.dtype = COMPUTE_DTYPE) -> Int4Linear:
        """From codes [N, K] in 0..15 and scale, zero [N, K/G] (``w = (q - 8) * scale + zero``)."""
        n, k = codes.shape
        if not cls.supports(n, k, group_size):
            raise ValueError(f"int4 packing needs out_features % 16 == 0 and in_features % {group_size} == 0, "
                             f"got {n} x {k}")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).to(compute_dtype).contiguous()
        return cls(packed, scales_and_zeros, group_size, None if bias is None else bias.detach())

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, group_size: int = INT4_GROUP_SIZE,
                   compute_dtype: torch.dtype = COMPUTE_DTYPE) -> Int4Linear:
        """Min/max asymmetric quantization per group of ``group_size`` inputs."""
        w = weight.detach().float()
        n, k = w.shape
        groups = w.reshape(n, k // group_size, group_size)
        lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
        # As for int8: scale and zero in the kernel's dtype first, the codes against those values.
        scale = ((hi - lo) / 15.0).clamp(min=1e-8).to(compute_dtype).float()
        zero = (lo + 8.0 * scale).to(compute_dtype).float()
        codes = torch.round((groups - zero[..., None]) / scale[..., None] + 8.0).clamp_(0, 15)
        return cls.from_groups(codes.reshape(n, k), scale, zero, bias, group_size, compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(_matmul_input(x, self.in_features, self.compute_dtype),
                                                       self.qweight, self.group_size, self.scales_and_zeros)
        return _finish(y, x, self.bias)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight this layer multiplies by: the kernel itself, in fp32, applied to the
        identity (exact: each output is one product ``1 * w`` plus zeros)."""
        eye = torch.eye(self.in_features, dtype=torch.float32)
        sz = self.scales_and_zeros.float()
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.qweight, self.group_size, sz).T.contiguous()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int4 groups of {self.group_size}, {self.compute_dtype}")
