"""The decoder layers run one at a time over the calibration samples (sequential calibration).

GPTQ's and AWQ's reference code quantize a model layer by layer: the calibration tokens go
through layer i with layers < i already quantized, layer i's input statistics are taken from
those activations, layer i is quantized, and its (quantized) output is the next layer's input.
Each layer's statistics then include the error the earlier layers made, and the method can
correct for it, where statistics from one pass of the float model tune every layer to inputs it
will not see.

``LayerRunner`` holds the hidden stream of every calibration token (``hidden`` and ``residual``,
the two halves pagoda's layers pass on: the stream is their sum) and runs pagoda's own decoder
layer modules on it, so every family's layer (Llama, Qwen's biases and q/k norms, Gemma 3's four
norms, sliding windows) is computed exactly as the engine computes it. Each sample is one causal
prefill sequence starting at position 0; the K/V a layer writes go into a scratch cache bound to
that layer for the call (the engine's own cache is left as it was).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from pagoda.forward_context import AttentionMetadata, PrefillSeq, set_attention_metadata
from pagoda.quantize.statistics import (
    InputStatistics,
    RecordingLinear,
    projection_owners,
)

CHUNK_TOKENS = 4096  # tokens run through a layer at once (bounds the MLP's [T, 2 * intermediate])
_SCRATCH_BLOCK = 16


@dataclass
class LayerInputs:
    """What one layer's projections saw: each one's statistics by name, and the inputs of the
    attention block (qkv's) and of the MLP (gate/up's) for the samples of the first chunks
    (``chunks``), which AWQ's scale search runs the blocks on."""

    stats: dict[str, InputStatistics]
    attention: torch.Tensor
    mlp: torch.Tensor
    chunks: list[tuple[int, int, int, int]]


class _CapturingLinear(RecordingLinear):
    """A recording projection that also keeps its input rows while ``keep`` is set."""

    def __init__(self, inner: nn.Module, stats: InputStatistics, backend) -> None:
        super().__init__(inner, stats, backend)
        self.keep, self.kept = False, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.keep:
            self.kept.append(x.detach().clone())
        return super().forward(x)


class LayerRunner:
    """The calibration tokens' hidden stream, advanced through ``model.layers`` one layer at a time."""

    def __init__(self, model: nn.Module, samples: Sequence[Sequence[int]], chunk_tokens: int = CHUNK_TOKENS) -> None:
        if not samples or any(len(s) == 0 for s in samples):
            raise ValueError("sequential calibration needs at least one non-empty sample")
        self.model = model
        self.lengths = [len(s) for s in samples]
        self.chunks = _chunks(self.lengths, chunk_tokens)
        ids = torch.tensor([t for s in samples for t in s], dtype=torch.long)
        self.positions = torch.cat([torch.arange(n) for n in self.lengths])
        with torch.inference_mode():
            self.hidden = model.embed(ids).float()
        self.residual: torch.Tensor | None = None  # None before the first layer, as in the model's forward
        self.tokens = len(ids)

    def record(self, index: int, capture_chunks: int = 0) -> LayerInputs:
        """Run layer ``index`` on the current stream with its projections recording their inputs;
        the stream is not advanced. The attention's and the MLP's inputs are kept for the first
        ``capture_chunks`` chunks of samples."""
        stats: dict[str, InputStatistics] = {}
        captured = []
        with _recording(self.model, index, stats) as wrappers:
            attention = wrappers.get(f"layers.{index}.self_attn.qkv_proj")
            mlp = wrappers.get(f"layers.{index}.mlp.gate_up_proj")
            for number, chunk in enumerate(self.chunks):
                keep = number < capture_chunks
                if keep:
                    captured.append(chunk)
                for w in (attention, mlp):
                    if w is not None:
                        w.keep = keep
                self._run_chunk(index, *chunk)
        join = lambda w: torch.cat(w.kept) if w is not None and w.kept else torch.zeros(0)
        return LayerInputs(stats, join(attention), join(mlp), captured)

    def attention_output(self, index: int, inputs: LayerInputs) -> torch.Tensor:
        """Layer ``index``'s attention block (with its weights as they are now) on the captured inputs."""
        attn = self.model.layers[index].self_attn
        outputs = []
        for first, last, start, stop in inputs.chunks:
            offset = start - inputs.chunks[0][2]
            x = inputs.attention[offset : offset + stop - start]
            with torch.inference_mode(), _scratch_cache(attn.attn, self.lengths[first:last]), \
                    set_attention_metadata(_prefill_metadata(self.lengths[first:last])):
                outputs.append(attn(self.positions[start:stop].contiguous(), x.clone()))
        return torch.cat(outputs)

    def mlp_output(self, index: int, inputs: LayerInputs) -> torch.Tensor:
        """Layer ``index``'s MLP (with its weights as they are now) on the captured inputs."""
        with torch.inference_mode():
            return self.model.layers[index].mlp(inputs.mlp)

    def advance(self, index: int) -> None:
        """Replace the stream by layer ``index``'s output (with the layer's weights as they are now)."""
        hidden, residual = zip(*self._run(index))
        self.hidden, self.residual = torch.cat(hidden), torch.cat(residual)

    def _run(self, index: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Layer ``index``'s (hidden, residual) outputs, chunk by chunk. The inputs are copied first:
        the C++ backend's fused add + norm writes into its arguments."""
        for chunk in self.chunks:
            yield self._run_chunk(index, *chunk)

    def _run_chunk(self, index: int, first: int, last: int, start: int, stop: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.model.layers[index]
        hidden = self.hidden[start:stop].clone()
        residual = None if self.residual is None else self.residual[start:stop].clone()
        with torch.inference_mode(), _scratch_cache(layer.self_attn.attn, self.lengths[first:last]), \
                set_attention_metadata(_prefill_metadata(self.lengths[first:last])):
            return layer(self.positions[start:stop].contiguous(), hidden, residual)


def _chunks(lengths: Sequence[int], budget: int) -> list[tuple[int, int, int, int]]:
    """(first sample, last sample + 1, first token, last token + 1) of consecutive samples, about
    ``budget`` tokens each (a longer sample is a chunk of its own)."""
    chunks, first, start, size = [], 0, 0, 0
    for i, n in enumerate(lengths):
        if size and size + n > budget:
            chunks.append((first, i, start, start + size))
            first, start, size = i, start + size, 0
        size += n
    chunks.append((first, len(lengths), start, start + size))
    return chunks


def _scratch_blocks(n: int) -> int:
    return -(-n // _SCRATCH_BLOCK)


def _prefill_metadata(lengths: Sequence[int]) -> AttentionMetadata:
    """Each sample one prefill from position 0, its K/V written to scratch blocks of its own, one
    after another (the C++ prefill kernel reads them back through the sample's block table)."""
    prefills, slots, offset, block = [], [], 0, 0
    for n in lengths:
        table = torch.arange(block, block + _scratch_blocks(n))
        prefills.append(PrefillSeq(token_start=offset, query_len=n, start=0, block_table=table))
        slots.append(torch.arange(n) + block * _SCRATCH_BLOCK)
        offset, block = offset + n, block + len(table)
    return AttentionMetadata(slot_mapping=torch.cat(slots), prefills=prefills, block_size=_SCRATCH_BLOCK)


@contextmanager
def _scratch_cache(attn: nn.Module, lengths: Sequence[int]) -> Iterator[None]:
    """A K/V cache with the blocks of samples of ``lengths`` bound to ``attn`` for the block; its
    own cache rebound after."""
    saved = attn.k_cache, attn.v_cache
    blocks = sum(_scratch_blocks(n) for n in lengths)
    shape = (blocks, attn.num_kv_heads, _SCRATCH_BLOCK, attn.head_dim)
    attn.bind_kv_cache(torch.zeros(shape), torch.zeros(shape))
    try:
        yield
    finally:
        attn.k_cache, attn.v_cache = saved


@contextmanager
def _recording(model: nn.Module, index: int, stats: dict[str, InputStatistics]
               ) -> Iterator[dict[str, _CapturingLinear]]:
    """Layer ``index``'s projections wrapped in recording ones for the block (yielded by name)."""
    prefix = f"layers.{index}."
    originals, wrappers = [], {}
    for name, parent, attr in projection_owners(model):
        if name.startswith(prefix):
            inner = getattr(parent, attr)
            stats[name] = InputStatistics(inner.in_features)
            wrappers[name] = _CapturingLinear(inner, stats[name], model.backend)
            setattr(parent, attr, wrappers[name])
            originals.append((parent, attr, inner))
    try:
        yield wrappers
    finally:
        for parent, attr, inner in originals:
            setattr(parent, attr, inner)
