"""What a trial runs: the tuned knobs (a `Setting`) over the engine flags the user started from.

The knobs are the engine flags that change serving speed on this machine:

- ``quantization`` (none / int8 / int4, and gguf for a GGUF model): bytes of weights streamed per step;
- ``num-threads``: CPU threads the engine computes with (fewer can win when other work shares the cores);
- ``dtype`` (float32 / bfloat16; the KV cache is kept in the model's dtype, there is no separate KV dtype);
- ``speculative-config`` (none, or n-gram drafts of 4 tokens);
- ``max-num-batched-tokens``: the per-step token budget (prefill chunk size: TTFT against ITL);
- ``max-num-seqs``: the most requests in a batch (throughput against ITL; the rest queue).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from pagoda.engine_args import EngineArgs, _option_fields

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4})

# The order in which the search visits the knobs; names as the flags spell them.
KNOBS = ("quantization", "num-threads", "dtype", "speculative-config", "max-num-batched-tokens", "max-num-seqs")


@dataclass(frozen=True)
class Setting:
    """The tuned knobs' values; None means the engine's default."""

    quantization: str | None = None
    num_threads: int | None = None
    dtype: str = EngineArgs.dtype
    speculative_config: str | None = None
    max_num_batched_tokens: int = EngineArgs.max_num_batched_tokens
    max_num_seqs: int = EngineArgs.max_num_seqs

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> Setting:
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
        if isinstance(values["speculative_config"], dict):
            values["speculative_config"] = json.dumps(values["speculative_config"])
        return cls(**values)

    def with_knob(self, knob: str, value: Any) -> Setting:
        return dataclasses.replace(self, **{knob.replace("-", "_"): value})

    def knob(self, knob: str) -> Any:
        return getattr(self, knob.replace("-", "_"))

    def engine_args(self, base: EngineArgs) -> EngineArgs:
        return dataclasses.replace(base, **dataclasses.asdict(self))

    def describe(self, start: Setting | None = None) -> str:
        """The knobs that differ from `start` (all of them without one), as `name=value`."""
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if start is None or value != getattr(start, f.name):
                parts.append(f"{f.name.replace('_', '-')}={_short(value)}")
        return " ".join(parts) or "(the start)"


def _short(value: Any) -> str:
    if value == NGRAM:
        return "ngram4"
    return "default" if value is None else str(value)


def candidates(knob: str, model_is_gguf: bool, cores: int | None = None) -> list[Any]:
    """The values a discrete knob is tried at (the default first)."""
    cores = cores or os.cpu_count() or 1
    if knob == "quantization":
        return [None, "int8", "int4"] + (["gguf"] if model_is_gguf else [])
    if knob == "num-threads":
        return [None] + sorted({max(1, cores // 2), 1} - {cores}, reverse=True)
    if knob == "dtype":
        return ["float32", "bfloat16"]
    if knob == "speculative-config":
        return [None, NGRAM]
    raise ValueError(f"{knob} is not a discrete knob")


def non_default_flags(args: EngineArgs, skip: tuple[str, ...] = ("model",)) -> dict[str, Any]:
    """The engine fields that differ from their defaults, as {flag name: value} (a config file's keys)."""
    out: dict[str, Any] = {}
    for f in _option_fields(EngineArgs):
        value = getattr(args, f.name)
        if f.name in skip or value == f.default or value is None:
            continue
        out[f.name.replace("_", "-")] = value
    return out


def command_flags(args: EngineArgs) -> list[str]:
    """The command-line flags that give `args` (all but --model), for `pagoda serve`."""
    flags: list[str] = []
    for name, value in non_default_flags(args).items():
        if isinstance(value, bool):
            flags.append(f"--{name}" if value else f"--no-{name}")
        elif isinstance(value, dict):
            flags.append(f"--{name}={json.dumps(value)}")
        else:
            flags.append(f"--{name}={value}")
    return flags


def config_mapping(args: EngineArgs) -> dict[str, Any]:
    """What `pagoda serve --config` needs to run `args`: the model and every non-default flag."""
    mapping: dict[str, Any] = {"model": args.model}
    for name, value in non_default_flags(args).items():
        if name == "speculative-config" and isinstance(value, str):
            value = json.loads(value)  # a mapping reads better in YAML; config_file writes it back as JSON
        mapping[name] = value
    return mapping
