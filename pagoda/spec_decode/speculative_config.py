"""`--speculative-config`: vLLM's `speculative_config` fields, parsed and checked (a ValueError
names the field). Resolving a draft model against the device is `pagoda.config`'s."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

SPECULATIVE_METHODS = ("ngram", "draft_model")
DEFAULT_DISABLE_BY_BATCH_SIZE = 4
DRAFT_MODEL_DISABLE_BY_BATCH_SIZE = 2
MAX_SPECULATIVE_TOKENS = 5  # the seeds cap a draft at 5 steps: errors accumulate past that


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config` fields). ``ngram``: prompt lookup, the
    tokens that followed the latest earlier occurrence of the sequence's last n tokens
    (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) are the draft. ``draft_model``:
    a smaller (or quantized) model sharing the target's tokenizer proposes them, greedily."""

    method: str = "ngram"
    model: str | None = None  # draft_model: any model pagoda loads (name, path, GGUF file)
    quantization: str | None = None  # ... with its own quantization
    dtype: str | None = None  # ... and dtype (default: the target's)
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # No drafts in a step with more running requests than this (vLLM's field): a batch already
    # shares each weight read, so verify rows cost nearly their full price, and a draft model's
    # passes grow with the batch too. The defaults (4 for ngram, 2 for draft_model) are where each
    # stopped paying (benchmarks/README.md, "Speculative decoding"). None: always.
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    # draft_model: fewer drafts (or none) for a request whose drafts the target keeps rejecting,
    # from its measured acceptance and the measured cost of a draft pass (spec_decode/draft_model.py)
    adaptive: bool = True
    # draft_model: the draft resolved against the device, a pagoda.config.ModelConfig
    # (create_engine_config fills it in; typed Any so that this module does not import config)
    draft: Any = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def parse(cls, value: dict | str | None) -> "SpeculativeConfig | None":
        """From a dict or its JSON text; a ValueError names the field that is wrong."""
        if value is None or value == "":
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)} - {"draft"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; known: {sorted(known)}")
        method = value.get("method", "draft_model" if "model" in value else "ngram")
        value = {**value, "method": method}
        if method == "draft_model" and "disable_by_batch_size" not in value:
            value["disable_by_batch_size"] = DRAFT_MODEL_DISABLE_BY_BATCH_SIZE
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(SPECULATIVE_METHODS)}, got {method!r}")
        config = cls(**{k: v for k, v in value.items() if k in known})
        config._validate()
        return config

    def _validate(self) -> None:
        k, lo, hi = self.num_speculative_tokens, self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(k, int) and 1 <= k <= MAX_SPECULATIVE_TOKENS):
            raise ValueError(f"speculative_config.num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(f"speculative_config.prompt_lookup_min/max must be integers with 1 <= min <= max, got {lo!r}, {hi!r}")
        limit = self.disable_by_batch_size
        if limit is not None and not (isinstance(limit, int) and limit >= 1):
            raise ValueError(f"speculative_config.disable_by_batch_size must be an integer >= 1 or null, got {limit!r}")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError("speculative_config.model: method 'draft_model' needs the draft's model (a name or path)")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {self.adaptive!r}")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config.model is for method 'draft_model', not 'ngram'")
