"""Calibration data: a JSON Lines file of texts, read into token-id samples.

One JSON object per line, either ``{"text": "..."}`` (tokenized as a plain prompt, the tokenizer's
own special tokens added) or ``{"messages": [{"role": ..., "content": ...}, ...]}`` (rendered with
the model's chat template). Blank lines are skipped. ``--num-samples`` of them are drawn at
random (seeded, so a run is repeatable) and each is cut to ``--max-sample-tokens``.

Without ``--calibration``, the set shipped with pagoda is used (``data/calibration.jsonl``:
512+ short texts written for pagoda and dedicated to the public domain; data/README.md).
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_CALIBRATION = Path(__file__).parent / "data" / "calibration.jsonl"


def read_records(path: Path | str) -> list[dict]:
    """The file's records; ValueError naming the line of a record that is neither form."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"calibration file {path} does not exist")
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not valid JSON ({e.msg})") from None
        text, messages = (record.get("text"), record.get("messages")) if isinstance(record, dict) else (None, None)
        if not (isinstance(text, str) and text.strip()) and not (isinstance(messages, list) and messages):
            raise ValueError(f'{path}:{number}: expected {{"text": "..."}} (non-empty) or {{"messages": [...]}}')
        records.append(record)
    if not records:
        raise ValueError(f"calibration file {path} has no samples")
    return records


def load_samples(path: Path | str | None, tokenizer, num_samples: int, max_tokens: int, seed: int = 0
                 ) -> list[list[int]]:
    """``num_samples`` records of ``path`` (default: the shipped set) as token ids, each at most
    ``max_tokens`` long. With fewer records than asked for, all are used (with a warning)."""
    if num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {num_samples}")
    if max_tokens < 1:
        raise ValueError(f"--max-sample-tokens must be >= 1, got {max_tokens}")
    path = DEFAULT_CALIBRATION if path is None else Path(path)
    records = read_records(path)
    if len(records) < num_samples:
        logger.warning("%s has %d samples, fewer than --num-samples %d: using all of them",
                       path, len(records), num_samples)
    chosen = random.Random(seed).sample(records, min(num_samples, len(records)))
    samples = []
    for record in chosen:
        if "text" in record and isinstance(record["text"], str):
            ids = tokenizer.encode(record["text"])
        else:
            ids = tokenizer.encode_chat(record["messages"], add_generation_prompt=False)
        if ids:
            samples.append(ids[:max_tokens])
    return samples
