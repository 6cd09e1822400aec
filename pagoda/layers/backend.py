"""The platform backend: which kernels the model's layers run, chosen once per model.

``select_backend(device)`` picks one at start-up: ``CpuKernelBackend`` (pagoda's C++ kernels,
built or loaded for this CPU), ``TorchBackend`` on a CPU without a compiler
(PAGODA_DISABLE_KERNELS=1 forces it), or ``TorchBackend`` on CUDA (torch's own kernels: SDPA,
cuBLAS). Layers capture the backend in effect when they are built (``building_with``) and call
it; no layer asks which kernels exist. The backend also builds each step's attention metadata
(from the model runner's arrays), owns the one-call decoder stack and the batch-invariant switch
(deterministic inference).

The C++ backend still falls back to torch per call where a kernel does not apply (bf16 / fp16
tensors, non-contiguous inputs, inside torch.compile, where inductor traces the torch code).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from pagoda.forward_context import AttentionMetadata, PrefillSeq
from pagoda.layers.cpu_kernels import kernel_isa, load_cpu_kernels
from pagoda.layers.ggml_formats import dequantize_blocks
from pagoda.layers.lora_delta import kernel_args, kernel_takes
from pagoda.scoped import Scoped
from pagoda.worker.kv_cache import SCALED_KV_DTYPES

logger = logging.getLogger(__name__)


class TorchBackend:
    """Pure torch: any device, any dtype."""

    has_cpu_kernels = False

    def __init__(self, device_type: str = "cpu") -> None:
        self.name = "cuda" if device_type == "cuda" else "torch"

    def describe(self) -> str:
        if self.name == "cuda":
            return "CUDA (torch: SDPA attention, cuBLAS matmuls)"
        return "pure torch on the CPU (no C++ kernels: no compiler, or PAGODA_DISABLE_KERNELS=1)"

    # -- elementwise ------------------------------------------------------------------------
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        residual = x + residual
        return rms_norm(residual, weight, eps), residual

    def rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
               sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = cos_cache[positions].unsqueeze(1).to(q.dtype)
        sin = sin_cache[positions].unsqueeze(1).to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def argmax_rows(x: torch.Tensor) -> torch.Tensor:
        """Each row's argmax (greedy sampling): the first of equal maxima, NaN counting as the largest."""
        return x.argmax(dim=-1)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GeGLU with the tanh approximation (Gemma's ``gelu_pytorch_tanh``); torch on every backend."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    # -- matmuls ----------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T``; ``packed``: the weight reordered for oneDNN at load (layers/packed_weights.py),
        which only the C++ backend uses."""
        return F.linear(x, weight)

    def lora_add(self, y: torch.Tensor, x: torch.Tensor, runs: list) -> None:
        """``y[rows] +=`` each run's LoRA delta (layers/lora_delta.ProjectionDelta) of ``x[rows]``, in place."""
        for delta, rows in runs:
            delta.add_to(y, x, rows)

    def block_matmul(self, x: torch.Tensor, blocks: torch.Tensor, block_type: int,
                     packed: torch.Tensor | None = None) -> torch.Tensor:
        """``packed``: the CPU kernels' packed copy of the weight (layers/packed_weights.py), if any."""
        return x.float() @ dequantize_blocks(blocks, block_type).T

    # -- paged attention --------------------------------------------------------------------
    def attention_metadata(self, slots: np.ndarray, decode_tables: np.ndarray | None,
                           decode_seq_lens: np.ndarray | None, prefills: list[tuple[int, int, int, np.ndarray]],
                           block_size: int, device: torch.device) -> AttentionMetadata:
        """The step's attention metadata on ``device``, from the runner's arrays: every token's
        KV slot; for decode-like rows their block tables and lengths; for each prefill chunk
        (first flat row, length, cached tokens before it, block table). This backend attends
        decode rows by gathering their blocks under a length mask, built here once per step."""
        meta = self._metadata(slots, decode_tables, decode_seq_lens, prefills, block_size, device)
        if meta.num_decodes:
            meta.decode_mask()
        return meta

    @staticmethod
    def _metadata(slots, decode_tables, decode_seq_lens, prefills, block_size, device) -> AttentionMetadata:
        def tensor(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device)

        meta = AttentionMetadata(
            slot_mapping=tensor(slots), block_size=block_size,
            prefills=[PrefillSeq(start, n, cached, tensor(table)) for start, n, cached, table in prefills],
        )
        if decode_seq_lens is not None and len(decode_seq_lens):
            meta.num_decodes = len(decode_seq_lens)
            meta.decode_block_tables, meta.decode_seq_lens = tensor(decode_tables), tensor(decode_seq_lens)
        return meta

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta,
                 k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> None:
        """K/V of the step's tokens into their slots: rounded where --kv-cache-dtype is narrower,
        quantized per (token, head) with the scales beside them for an int8 or fp8 cache."""
        blocks, offsets = meta.slot_blocks_and_offsets()
        if k_cache.dtype in SCALED_KV_DTYPES:
            for x, cache, scales in ((k, k_cache, k_scales), (v, v_cache, v_scales)):
                values, row_scales = quantize_rows(x, k_cache.dtype)
                cache[blocks, :, offsets] = values
                scales[blocks, :, offsets] = row_scales
            return
        k_cache[blocks, :, offsets] = k.to(k_cache.dtype)
        v_cache[blocks, :, offsets] = v.to(v_cache.dtype)

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta,
                         scale: float, window: int | None = None, k_scales: torch.Tensor | None = None,
                         v_scales: torch.Tensor | None = None) -> torch.Tensor:
        """One query row per decode-like token over its block table: gather, then one masked SDPA
        (with a sliding ``window``, the mask keeps each row's last ``window`` positions)."""
        keys = read_blocks(k_cache, k_scales, meta.decode_block_tables, q.dtype)
        values = read_blocks(v_cache, v_scales, meta.decode_block_tables, q.dtype)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask(window),
                                             scale=scale, enable_gqa=q.shape[1] != keys.shape[1])
        return out.squeeze(2)

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, seq: PrefillSeq, scale: float, window: int | None = None,
                          k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> torch.Tensor:
        """One prefill chunk ``seq`` (q: [Lq, Hq, D]; its k / v, already in the cache) over its
        sequence, causal and within ``window``: one SDPA call, over the chunk's own K/V when
        nothing is cached before it, else over the prefix gathered from the cache."""
        gqa = q.shape[1] != k.shape[1]
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
        if seq.start == 0 and (window is None or seq.query_len <= window):
            # Nothing cached before this chunk, and every query sees all keys before it: plain causal.
            out = F.scaled_dot_product_attention(qh, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                                                 is_causal=True, scale=scale, enable_gqa=gqa)
        elif seq.start == 0:
            # Nothing cached, but the chunk is longer than the window: a banded causal mask.
            pos = torch.arange(seq.query_len, device=q.device)
            mask = _visible(pos.unsqueeze(1), pos.unsqueeze(0), window)
            out = F.scaled_dot_product_attention(qh, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                                                 attn_mask=mask, scale=scale, enable_gqa=gqa)
        else:
            total = seq.start + seq.query_len
            bs = k_cache.shape[2]
            # Blocks wholly before the first query's window are not gathered.
            first = 0 if window is None else max(0, seq.start - window + 1) // bs
            table = seq.block_table[first : -(-total // bs)]
            begin = first * bs
            keys = read_blocks(k_cache, k_scales, table, q.dtype)[:, : total - begin].unsqueeze(0)
            values = read_blocks(v_cache, v_scales, table, q.dtype)[:, : total - begin].unsqueeze(0)
            q_pos = torch.arange(seq.start, total, device=q.device).unsqueeze(1)
            mask = _visible(q_pos, torch.arange(begin, total, device=q.device).unsqueeze(0), window)  # [Lq, keys]
            out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
        return out.squeeze(0).transpose(0, 1)

    # -- the model as a whole ---------------------------------------------------------------
    def decode_stack_ops(self):
        """The compiled ops the one-call decoder stack (models/decode_stack.py) runs on, or None:
        the Python layers run."""
        return None

    @contextlib.contextmanager
    def batch_invariant(self, enabled: bool) -> Iterator[bool]:
        """Compute every row the same way whatever the batch (deterministic inference); yields
        whether this backend can."""
        yield False


class CpuKernelBackend(TorchBackend):
    """pagoda's C++ kernels (layers/cpu_kernels.py, csrc/): float32 on the CPU."""

    has_cpu_kernels = True

    def __init__(self, ops) -> None:
        super().__init__("cpu")
        self.name = "cpu-kernels"
        self.ops = ops

    def describe(self) -> str:
        return f"pagoda C++ kernels for this CPU ({kernel_isa()})"

    def _fast(self, x: torch.Tensor, contiguous: bool = True) -> bool:
        """The float32 kernels apply (outside torch.compile, which traces the torch code)."""
        return (x.dtype == torch.float32 and x.device.type == "cpu" and not torch.compiler.is_compiling()
                and (not contiguous or x.is_contiguous()))

    def add_rms_norm(self, x, residual, weight, eps):
        if self._fast(x) and weight.dtype == torch.float32 and residual.is_contiguous():
            self.ops.fused_add_rms_norm(x, residual, weight, eps)  # in place on both
            return x, residual
        return super().add_rms_norm(x, residual, weight, eps)

    def rotary(self, q, k, positions, cos_cache, sin_cache):
        if self._fast(q, contiguous=False) and k.dtype == torch.float32 and q.stride(-1) == k.stride(-1) == 1 \
                and positions.is_contiguous():
            self.ops.rotary_embedding(q, k, positions, cos_cache, sin_cache)  # in place
            return q, k
        return super().rotary(q, k, positions, cos_cache, sin_cache)

    def silu_and_mul(self, gate_up):
        if self._fast(gate_up):
            return self.ops.silu_and_mul(gate_up)
        return super().silu_and_mul(gate_up)

    def argmax_rows(self, x):
        if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 0:
            return self.ops.argmax_rows(x)
        return super().argmax_rows(x)

    def linear(self, x, weight, packed=None):
        if self._fast(x) and x.dim() == 2 and weight.dtype == torch.float32 and weight.is_contiguous():
            return self.ops.linear(x, weight, packed)
        return super().linear(x, weight)

    def lora_add(self, y, x, runs):
        if x.dtype == y.dtype == torch.float32 and kernel_takes({delta.a.dtype for delta, _ in runs}) \
                and x.stride(-1) == 1 and y.stride(-1) == 1 and x.dim() == y.dim() == 2:
            self.ops.lora_add(y, x, *kernel_args(runs))
        else:  # a bf16 base: torch's matmuls
            super().lora_add(y, x, runs)

    def block_matmul(self, x, blocks, block_type, packed=None):
        if x.device.type == "cpu":
            # packed: the blocks' copy packed at load (tiles: every row count; bf16: from 16 rows, not
            # under batch invariance)
            return self.ops.block_matmul(x.float(), blocks, block_type, None if torch.compiler.is_compiling() else packed)
        return super().block_matmul(x, blocks, block_type)

    def attention_metadata(self, slots, decode_tables, decode_seq_lens, prefills, block_size, device):
        """As the torch backend's, without the mask: the paged kernel reads each row's blocks in
        place up to its length."""
        return self._metadata(slots, decode_tables, decode_seq_lens, prefills, block_size, device)

    def write_kv(self, k, v, k_cache, v_cache, meta, k_scales=None, v_scales=None):
        if k.device.type == "cpu":
            self.ops.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, k_scales, v_scales)
        else:
            super().write_kv(k, v, k_cache, v_cache, meta, k_scales, v_scales)

    def decode_attention(self, q, k_cache, v_cache, meta, scale, window=None, k_scales=None, v_scales=None):
        if q.device.type == "cpu":
            return self.ops.paged_decode_attention(q.contiguous(), k_cache, v_cache, meta.decode_block_tables,
                                                   meta.decode_seq_lens, scale, window or 0, k_scales, v_scales)
        return super().decode_attention(q, k_cache, v_cache, meta, scale, window, k_scales, v_scales)

    def prefill_attention(self, q, k, v, k_cache, v_cache, seq, scale, window=None, k_scales=None, v_scales=None):
        """The flash-style kernel (csrc/prefill_attention.cpp): keys and values read from the
        cache in place, the chunk's own included, a tile of keys at a time for a tile of rows;
        faster than SDPA over the gathered prefix on every shape measured (benchmarks/README.md)."""
        if q.device.type == "cpu":
            return self.ops.paged_prefill_attention(q.contiguous(), k_cache, v_cache, seq.block_table, seq.start,
                                                    scale, window or 0, k_scales, v_scales)
        return super().prefill_attention(q, k, v, k_cache, v_cache, seq, scale, window, k_scales, v_scales)

    def decode_stack_ops(self):
        return self.ops

    @contextlib.contextmanager
    def batch_invariant(self, enabled: bool) -> Iterator[bool]:
        previous = self.ops.set_batch_invariant(enabled)
        try:
            yield True
        finally:
            if previous != enabled:  # (a call a step saved where the switch stays as it was)
                self.ops.set_batch_invariant(previous)


def select_backend(device: torch.device | str) -> TorchBackend:
    """The backend for ``device``: the C++ kernels where they build (CPU), else torch's."""
    device = torch.device(device)
    if device.type == "cpu":
        ops = load_cpu_kernels()
        if ops is not None:
            return CpuKernelBackend(ops)
    return TorchBackend(device.type)


_building: Scoped[TorchBackend | None] = Scoped("pagoda_backend", None)


def building_with(backend: TorchBackend) -> contextlib.AbstractContextManager:
    """Layers built inside the block use ``backend``."""
    return _building.using(backend)


def current_backend() -> TorchBackend:
    """The backend of the model being built; outside ``building_with`` (a layer built on its own,
    in a test) the CPU's, chosen now."""
    backend = _building.get()
    return backend if backend is not None else select_backend("cpu")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def gather_blocks(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Blocks of one or more sequences → [..., Hkv, L, D] with L = blocks * block_size."""
    x = cache[block_table]  # [..., nb, Hkv, bs, D]
    return x.transpose(-4, -3).flatten(-3, -2)


def read_blocks(cache: torch.Tensor, scales: torch.Tensor | None, block_table: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """``gather_blocks`` widened to ``dtype``: an int8 or fp8 cache times its per-(token, head) scales."""
    x = gather_blocks(cache, block_table)
    if scales is None:
        return x.to(dtype)
    row_scales = scales[block_table].transpose(-3, -2).flatten(-2, -1)  # [..., Hkv, L]
    return (x.float() * row_scales.unsqueeze(-1)).to(dtype)


def quantize_rows(x: torch.Tensor, dtype: torch.dtype = torch.int8) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] → codes of ``dtype`` (int8, fp8 e4m3 / e5m2) and one float scale per row (its
    largest magnitude over the code's largest value, ``SCALED_KV_DTYPES``; 0 for a row of zeros),
    divided and rounded to nearest even: what the C++ write_kv_cache stores for such a cache."""
    largest = SCALED_KV_DTYPES[dtype]
    x = x.float()
    scales = x.abs().amax(dim=-1) / largest
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    scaled = x / divisor.unsqueeze(-1)
    if dtype == torch.int8:
        return torch.round(scaled).to(torch.int8), scales
    return scaled.clamp_(-largest, largest).to(dtype), scales


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Which keys each query sees: causal, and within the sliding window when there is one."""
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask
