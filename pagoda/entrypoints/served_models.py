"""What `pagoda serve` serves: one `--model`, several (`--model A --model B`), or a models file
(`--models-file models.yaml`), and the options of a server of several models (keep_alive,
memory budget, loaded models, load timeout). The pool that loads them: model_pool.py.

A models file lists the models and, for each, any engine flag of `pagoda serve` (by its long
name, with `_` or `-`), which overrides the command line's for that model only::

    models:
      - model: smollm2                 # what --model takes (required)
        served_model_name: [smol]      # names requests use (default: the model)
        keep_alive: 10m                # after its last request (default: --keep-alive)
        preload: true                  # load at start-up instead of on first use
        max_model_len: 2048
        kv_cache_memory: 0.5
      - model: ./qwen2.5-0.5b-q4_0.gguf
        quantization: gguf
"""

from __future__ import annotations

import argparse
import copy
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from pagoda.engine_args import EngineArgs
from pagoda.loader.catalog import catalog_aliases

SPEC_KEYS = {"model", "served_model_name", "keep_alive", "preload"}
DEFAULT_KEEP_ALIVE = 300.0  # Ollama's default: five minutes
FOREVER = None  # keep_alive of a model that stays loaded until the server stops


@dataclass
class ModelSpec:
    """One model the server may serve: its names, the namespace of serve flags it loads with
    (the command line's, with the model's own engine flags from a models file), keep_alive."""

    names: list[str]
    args: Any  # argparse.Namespace of `pagoda serve`, `model` set to this model
    keep_alive: float | None = DEFAULT_KEEP_ALIVE
    preload: bool = False
    aliases: list[str] = field(default_factory=list)  # other names requests may use (catalog names)
    config: Any = None  # the EngineConfig (files, dtype, context), resolved at start-up
    description: dict | None = None  # Ollama's description of it (model_dispatch._description)

    @property
    def name(self) -> str:
        return self.names[0]

    def accepts(self, name: str) -> bool:
        return name in self.names or name in self.aliases



# -- keep_alive values: Ollama's durations ------------------------------------------------------
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value: Any) -> float | None:
    """Seconds from Ollama's `keep_alive`: a number of seconds or a Go duration ("5m", "1h30m",
    "-1s"); negative means forever (None). Raises ValueError naming the value."""
    if isinstance(value, bool):
        raise ValueError(f"keep_alive must be a duration such as \"5m\" or a number of seconds, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            sign = -1.0 if text.startswith("-") else 1.0
            body = text.lstrip("+-")
            parts = _DURATION_PART.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise ValueError(f"keep_alive must be a duration such as \"5m\", \"1h30m\" or \"-1\", "
                                 f"got {value!r}") from None
            seconds = sign * sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
    else:
        raise ValueError(f"keep_alive must be a duration such as \"5m\" or a number of seconds, got {value!r}")
    return FOREVER if seconds < 0 else seconds




class ModelsAction(argparse.Action):
    """`--model`, repeatable on `pagoda serve`: `model` holds the first, `models` all of them."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        models = [*(getattr(namespace, "models", None) or []), values]
        namespace.models = models
        namespace.model = models[0]


def model_option_overrides() -> dict[str, dict[str, Any]]:
    """serve's `--model` (EngineArgs.add_cli_args' overrides)."""
    return {"model": {"action": ModelsAction, "help": "HF model directory, .gguf file, catalog or store name; "
                      "repeat it to serve several models, loaded on first use (default: %(default)s)"}}


def add_model_tag(parser: argparse.ArgumentParser) -> None:
    """`pagoda serve MODEL`, as `vllm serve MODEL`: the model as a positional argument."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model to serve, as `vllm serve MODEL` takes it; the same as --model MODEL")


def apply_model_tag(args: argparse.Namespace) -> None:
    """Make a positional MODEL the one model served. ValueError where --model is on the command
    line too (a --config file's model gives way to it, as the file's other flags do)."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    if any(arg == "--model" or arg.startswith("--model=") for arg in getattr(args, "argv", ())):
        raise ValueError(f"the model is given twice: as {tag!r} and with --model; give MODEL alone, or serve "
                         "several with --model A --model B")
    args.model, args.models = tag, [tag]


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(models=None)
    group = parser.add_argument_group("several models (--model A --model B, or --models-file)")
    group.add_argument("--models-file", default=None,
                       help="YAML or JSON list of models to serve, each with its own engine flags "
                            "(pagoda/entrypoints/served_models.py)")
    group.add_argument("--keep-alive", default="5m",
                       help="how long a model stays loaded after its last request (Ollama's keep_alive: 5m, 1h, "
                            "0 = unload at once, -1 = never); a request's keep_alive overrides it")
    group.add_argument("--max-loaded-models", type=int, default=3,
                       help="models loaded at once; loading one more unloads the least recently used idle one")
    group.add_argument("--models-memory", type=float, default=None,
                       help="GiB the loaded models may take together (weights + KV cache, estimated from the "
                            "files; default: 3/4 of the memory available at start-up)")
    group.add_argument("--load-timeout", type=float, default=300.0,
                       help="seconds a request waits for its model to load (and for room to load it)")


def serves_several(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "models_file", None)) or len(getattr(args, "models", None) or []) > 1


def model_specs(args: argparse.Namespace) -> list[ModelSpec]:
    """The ModelSpecs of serve's options; a ValueError names what is wrong."""
    default_keep_alive = _keep_alive(args.keep_alive, "--keep-alive")
    if args.models_file:
        if args.models:
            raise ValueError("give the models with --model or in --models-file, not both")
        entries = read_models_file(args.models_file)
    else:
        names = args.served_model_name
        if names and len(names) != len(args.models):
            raise ValueError(f"--served-model-name: give one name per --model ({len(args.models)} models, "
                             f"{len(names)} names), or use --models-file for several names per model")
        entries = [{"model": m, **({"served_model_name": [names[i]]} if names else {})}
                   for i, m in enumerate(args.models)]
    specs = [_spec(args, entry, default_keep_alive) for entry in entries]
    if not specs:
        raise ValueError("no model to serve")
    return specs


def _spec(args: argparse.Namespace, entry: dict, default_keep_alive: float | None) -> ModelSpec:
    ns = copy.copy(args)
    ns.model, ns.models = entry["model"], None
    for key, value in entry.items():
        if key not in SPEC_KEYS:
            setattr(ns, key, value)
    EngineArgs.from_cli_args(ns)._validate()
    names = entry.get("served_model_name") or [entry["model"]]
    ns.served_model_name = names
    keep_alive = _keep_alive(entry["keep_alive"], f"keep_alive of {entry['model']}") \
        if "keep_alive" in entry else default_keep_alive
    return ModelSpec(names=list(names), args=ns, keep_alive=keep_alive, preload=bool(entry.get("preload", False)),
                     aliases=[a for a in catalog_aliases(entry["model"], names) if a not in names])


def _keep_alive(value: Any, where: str) -> float | None:
    try:
        return parse_keep_alive(value)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def read_models_file(path: str) -> list[dict]:
    """The entries of a models file, checked: each a mapping with `model`, keys that are engine
    flags or SPEC_KEYS (an unknown key is an error naming it and its entry)."""
    import yaml  # deferred: yaml loads on first use

    try:
        data = yaml.safe_load(Path(path).expanduser().read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"--models-file {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--models-file {path}: not YAML or JSON ({e})") from None
    entries = data.get("models") if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"--models-file {path}: expected a list of models (under `models:`)")
    engine_keys = {f.name for f in fields(EngineArgs) if f.metadata.get("cli") is not None} - {"model"}
    checked = []
    for i, entry in enumerate(entries, 1):
        where = f"--models-file {path}, model {i}"
        if isinstance(entry, str):
            entry = {"model": entry}
        if not isinstance(entry, dict) or not isinstance(entry.get("model"), str):
            raise ValueError(f"{where}: expected a mapping with `model: NAME`")
        entry = {str(k).replace("-", "_"): v for k, v in entry.items()}
        unknown = sorted(set(entry) - engine_keys - SPEC_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)} (engine flags of `pagoda serve`, "
                             f"or {', '.join(sorted(SPEC_KEYS))})")
        names = entry.get("served_model_name")
        if isinstance(names, str):
            entry["served_model_name"] = [names]
        elif names is not None and not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)):
            raise ValueError(f"{where}: served_model_name must be a name or a list of names")
        checked.append(entry)
    return checked


def default_memory_budget() -> int:
    """3/4 of the memory available now (the models' budget when --models-memory is not given)."""
    import torch  # torch loads on first use

    from pagoda.platform import available_memory_bytes  # deferred: loads torch

    return int(available_memory_bytes(torch.device("cpu")) * 3 / 4)

