"""The vision side of a step: the rows a step's prompt chunks take from their images.

An image's rows come from the model's vision encoder (``model.encode_images``: tower and
projector). The images a step first reaches are encoded together, one batch across requests
(stacked by pixel shape), and kept until the chunk that computes the end of the image's run;
each chunk then takes the rows of the part of the run it computes, in place of its placeholder
tokens' embeddings. For a model whose image tokens attend to each other both ways
(``bidirectional_image_attention``, Gemma 3) the chunk's prefill metadata names the images'
spans (layers/image_attention.py), and such a chunk never runs as decode rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagoda import envs
from pagoda.forward_context import AttentionMetadata
from pagoda.worker.batch_layout import BatchLayout
from pagoda.worker.input_batch import InputBatch


@dataclass
class StepImages:
    """What one step takes from images: (flat row, key, first row, end row) of each piece."""

    pieces: list[tuple[int, tuple[str, int], int, int]] = field(default_factory=list)


class ImageEmbeddings:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        chunk = envs.PAGODA_VISION_ATTENTION_CHUNK
        if chunk:  # (a tower's attention in query chunks: the same result, fewer scores held at once)
            model.vision_tower.attention_chunk = int(chunk)
        self.bidirectional = bool(getattr(model, "bidirectional_image_attention", False))
        self._rows: dict[tuple[str, int], torch.Tensor] = {}  # (request, image) → its rows [length, hidden]
        self.images_encoded = 0  # (counted for tests and the benchmark)
        self.encoder_batches = 0

    def holds_images(self, batch: InputBatch, req_ids: list[str], starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """bool per request: this step's tokens of it include image tokens that attend both ways."""
        out = np.zeros(len(req_ids), dtype=bool)
        if not self.bidirectional:
            return out
        for i, rid in enumerate(req_ids):
            start, end = int(starts[i]), int(starts[i] + counts[i])
            out[i] = any(im.offset < end and start < im.end for im in batch.states[rid].images)
        return out

    def step(self, batch: InputBatch, lay: BatchLayout, meta: AttentionMetadata) -> StepImages | None:
        """This step's pieces of images, encoding the images it reaches first (None: no image)."""
        for key in [k for k in self._rows if k[0] not in batch.states]:  # finished or aborted mid-image
            del self._rows[key]
        step, spans, wanted = StepImages(), {}, {}
        for i, rid in enumerate(lay.req_ids):
            images = batch.states[rid].images
            start, end, offset = int(lay.starts[i]), int(lay.starts[i] + lay.counts[i]), int(lay.offsets[i])
            for j, image in enumerate(images):
                lo, hi = max(start, image.offset), min(end, image.end)
                if lo >= hi:
                    continue
                key = (rid, j)
                if key not in self._rows:
                    wanted[key] = image.pixel_values
                step.pieces.append((offset + lo - start, key, lo - image.offset, hi - image.offset))
                spans.setdefault(i, []).append((image.offset, image.end))
        if not step.pieces:
            return None
        self._encode(wanted)
        if self.bidirectional:
            _mark_spans(meta, lay, spans)
        return step

    def _encode(self, wanted: dict[tuple[str, int], torch.Tensor]) -> None:
        """Every wanted image in one encoder batch per pixel shape."""
        by_shape: dict[tuple[int, ...], list[tuple[str, int]]] = {}
        for key, pixels in wanted.items():
            by_shape.setdefault(tuple(pixels.shape), []).append(key)
        device = self.model.embed_tokens.weight.device
        for keys in by_shape.values():
            rows = self.model.encode_images(torch.stack([wanted[k] for k in keys]).to(device))
            self.encoder_batches += 1
            self.images_encoded += len(keys)
            for key, image_rows in zip(keys, rows):
                self._rows[key] = image_rows

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepImages) -> torch.Tensor:
        """The model over the step's rows: token embeddings, each image piece's rows in its place
        (eager: the rows are replaced before the first layer). An image's rows are let go once
        the piece that ends its run is placed."""
        hidden = self.model.embed(input_ids)
        for flat, key, first, end in step.pieces:
            rows = self._rows[key]
            hidden[flat : flat + end - first] = rows[first:end].to(hidden.dtype)
            if end == rows.shape[0]:
                del self._rows[key]
        return self.model(input_ids, positions, hidden)


def _mark_spans(meta: AttentionMetadata, lay: BatchLayout, spans: dict[int, list[tuple[int, int]]]) -> None:
    """Give each prefill chunk holding images their spans, in every KV cache group's metadata."""
    for group in meta.groups or [meta]:
        for k, seq in enumerate(group.prefills):
            found = spans.get(lay.num_decode_like + k)
            if found:
                seq.image_spans = tuple(found)
