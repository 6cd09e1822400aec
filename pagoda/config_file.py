"""`--config FILE`: a command's flags from a YAML file, as vLLM's `vllm serve --config`.

Each key is a long flag of the command without its leading dashes (``max-num-seqs: 8``; the
underscore spelling ``max_num_seqs`` is accepted too), each value what the flag takes:

    model: smollm2
    max-num-seqs: 8
    quantization: int8
    enable-prefix-caching: false      # --no-enable-prefix-caching
    served-model-name: [a, b]         # a flag that takes several values
    speculative-config: {method: ngram, num_speculative_tokens: 4}   # written back as JSON

Flags given on the command line win over the file's. A key that names no flag of the command is
an error that names the key. The file's values go through argparse like typed flags (types and
choices are checked the same way), so a file means exactly what the same flags would. `pagoda tune`
writes such files.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CONFIG_DEST = "config"
_PARSER_DEST = "config_parser"  # the subcommand's parser, so that its flags can be looked up


def add_cli_arg(parser: argparse.ArgumentParser) -> None:
    """Give a (sub)command `--config FILE`."""
    parser.add_argument("--config", dest=CONFIG_DEST, default=None, metavar="FILE.yaml",
                        help="read flags from a YAML file (keys: long flag names without --); "
                             "flags on the command line win")
    parser.set_defaults(**{_PARSER_DEST: parser})


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """`parser.parse_args(argv)`, with the flags of a subcommand's `--config FILE` added where the
    command line does not give them."""
    argv = list(argv)
    ns = parser.parse_args(argv)
    sub: argparse.ArgumentParser | None = vars(ns).pop(_PARSER_DEST, None)  # not for the command to see
    path = getattr(ns, CONFIG_DEST, None)
    if not path:
        return ns
    try:
        extra = config_args(sub, read_config(path), given=argv)
    except ValueError as e:
        sub.error(str(e))  # exits 2 with "pagoda serve: error: ..."
    ns = parser.parse_args(argv + extra)
    vars(ns).pop(_PARSER_DEST, None)
    return ns


def read_config(path: str | Path) -> dict[str, Any]:
    """The file's mapping; ValueError if it cannot be read or is not a mapping of names."""
    import yaml  # deferred: yaml loads on first use

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values, got {type(data).__name__}")
    return data


def config_args(parser: argparse.ArgumentParser, config: dict[str, Any], *, given: Sequence[str] = ()) -> list[str]:
    """The command-line arguments that say what `config` says, leaving out the flags already in
    `given` (the command line, which wins). ValueError names a key that is no flag of `parser`."""
    by_flag = {opt: action for action in parser._actions for opt in action.option_strings}
    args: list[str] = []
    for key, value in config.items():
        flag = "--" + key.strip().lstrip("-").replace("_", "-")
        action = by_flag.get(flag)
        if action is None or flag in ("--config", "--help"):
            raise ValueError(f"unknown key {key!r} in the config file: {parser.prog} has no {flag} option")
        if value is None or _given(action, given):
            continue
        args += _as_args(flag, action, value, key)
    return args


def _given(action: argparse.Action, argv: Sequence[str]) -> bool:
    """Whether the command line sets this option (any of its spellings, `--flag=value` too)."""
    return any(tok in action.option_strings or tok.split("=", 1)[0] in action.option_strings
               for tok in argv if tok.startswith("-"))


def _as_args(flag: str, action: argparse.Action, value: Any, key: str) -> list[str]:
    """One key's value as arguments: a flag for a true bool, --no-x for a false one where the
    option has it, each item for a list, JSON for a mapping."""
    if isinstance(action, argparse.BooleanOptionalAction):
        _check_bool(value, key)
        return [flag if value else "--no-" + flag[2:]]
    if action.nargs == 0:  # store_true / store_false / store_const
        _check_bool(value, key)
        return [flag] if value else []
    items = value if isinstance(value, list) else [value]
    if isinstance(action, argparse._AppendAction):
        return [f"{flag}={_text(v)}" for v in items]
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        return [flag, *(_text(v) for v in items)]
    if isinstance(value, list):
        raise ValueError(f"key {key!r} in the config file: {flag} takes one value, got a list")
    return [f"{flag}={_text(value)}"]


def _check_bool(value: Any, key: str) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"key {key!r} in the config file is an on/off flag: give true or false, got {value!r}")


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)
