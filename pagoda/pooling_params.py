"""Pooling: how a model of the pooling runner (`--runner pooling`) turns a prompt's hidden states
into one vector (``PoolerConfig``, the model's, resolved once), and what one request asks of it
(``PoolingParams``, vLLM's names). Validated on construction; errors name the field."""

from __future__ import annotations

import json
from dataclasses import dataclass

POOLING_TYPES = ("MEAN", "CLS", "LAST")
POOLING_TASKS = ("embed", "score")


@dataclass(frozen=True)
class PoolerConfig:
    """The model's pooling: over which tokens (MEAN: all of the prompt, CLS: the first, LAST: the
    last), whether the vector is scaled to unit length, and the widths a request may cut it to
    (``dimensions``): a Matryoshka model's (None: any width up to the full one; an empty tuple:
    none, the model was not trained for it)."""

    pooling_type: str = "LAST"
    normalize: bool = True
    matryoshka_dimensions: tuple[int, ...] | None = ()

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooler_config.pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                             f"got {self.pooling_type!r}")

    @property
    def is_matryoshka(self) -> bool:
        return self.matryoshka_dimensions != ()

    def with_overrides(self, text: str | dict | None) -> PoolerConfig:
        """This config with `--pooler-config`'s fields (JSON: pooling_type, normalize) over it."""
        if text is None:
            return self
        given = json.loads(text) if isinstance(text, str) else dict(text)
        if not isinstance(given, dict):
            raise ValueError(f"pooler_config must be a JSON object, got {text!r}")
        unknown = set(given) - {"pooling_type", "normalize"}
        if unknown:
            raise ValueError(f"pooler_config: unknown fields {sorted(unknown)} (pooling_type, normalize)")
        pooling_type = str(given.get("pooling_type", self.pooling_type)).upper()
        return PoolerConfig(pooling_type, bool(given.get("normalize", self.normalize)), self.matryoshka_dimensions)


@dataclass
class PoolingParams:
    """One pooling request's parameters (vLLM's PoolingParams).

    ``task``: "embed" (the vector) or "score" (a vector for a cosine score); ``dimensions``: keep
    the first n values (a Matryoshka model's), then normalize; ``normalize``: None for the model's
    own setting; ``truncate_prompt_tokens``: keep only the prompt's last n tokens (-1: the most
    the model takes), else a prompt longer than the model's context is refused."""

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be a positive integer or -1, got {t!r}")

    def check_against(self, pooler: PoolerConfig, hidden_size: int) -> None:
        """Refuse what the model cannot give: ``dimensions`` on a model not trained for it, or
        wider than its vectors, or a width its Matryoshka list does not hold."""
        if self.dimensions is None:
            return
        if not pooler.is_matryoshka:
            raise ValueError("dimensions: this model does not support Matryoshka representation (it was not trained "
                             "for shorter vectors), so it cannot change its output dimensions")
        allowed = pooler.matryoshka_dimensions
        if self.dimensions > hidden_size or (allowed and self.dimensions not in allowed):
            widths = ", ".join(map(str, allowed)) if allowed else f"1 to {hidden_size}"
            raise ValueError(f"dimensions must be one of the model's widths ({widths}), got {self.dimensions}")
