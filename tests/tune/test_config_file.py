"""`--config FILE.yaml` (pagoda/config_file.py): flags from a file, the command line wins, unknown keys fail.

These parse the real `pagoda` command line; tests/tune/test_tune.py starts `pagoda serve --config`
on the file the tuner wrote.
"""

from __future__ import annotations

import json

import pytest

from pagoda import config_file
from pagoda.engine_args import EngineArgs
from pagoda.cli import build_parser


def _parse(argv: list[str]):
    return config_file.parse_args(build_parser(), argv)


def _write(tmp_path, text: str):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def test_serve_reads_every_kind_of_flag_from_the_file(tmp_path):
    path = _write(tmp_path, """
model: smollm2
max-num-seqs: 12
max_num_batched_tokens: 512          # the underscore spelling works too
quantization: int8
enable-prefix-caching: false          # --no-enable-prefix-caching
compile: true                         # a store_true flag
served-model-name: [a, b]             # nargs="+"
speculative-config: {method: ngram, num_speculative_tokens: 3}
num-threads: 1
port: 9123
""")
    ns = _parse(["serve", "--config", path])
    args = EngineArgs.from_cli_args(ns)
    assert (args.model, args.max_num_seqs, args.max_num_batched_tokens, args.quantization) == ("smollm2", 12, 512, "int8")
    assert args.enable_prefix_caching is False and args.compile is True and args.num_threads == 1
    assert json.loads(args.speculative_config) == {"method": "ngram", "num_speculative_tokens": 3}
    assert ns.served_model_name == ["a", "b"] and ns.port == 9123


def test_the_command_line_wins_over_the_file(tmp_path):
    path = _write(tmp_path, "max-num-seqs: 12\nquantization: int8\nenable-prefix-caching: false\nport: 9123\n")
    ns = _parse(["serve", "--max-num-seqs", "3", "--config", path, "--enable-prefix-caching", "--port=9000"])
    assert (ns.max_num_seqs, ns.enable_prefix_caching, ns.port) == (3, True, 9000)
    assert ns.quantization == "int8"  # not on the command line: the file's
    ns = _parse(["serve", "--config", path])
    assert (ns.max_num_seqs, ns.enable_prefix_caching, ns.port) == (12, False, 9123)


def test_generate_and_chat_take_a_config_too(tmp_path):
    path = _write(tmp_path, 'max-tokens: 5\ntemperature: 0\nstop: ["\\n", "."]\n')
    ns = _parse(["generate", "Hello", "--config", path])
    assert (ns.prompt, ns.max_tokens, ns.temperature, ns.stop) == ("Hello", 5, 0.0, ["\n", "."])
    ns = _parse(["generate", "--config", path, "--stop", "!", "Hello"])
    assert ns.stop == ["!"]  # a repeatable flag on the command line replaces the file's list
    assert _parse(["chat", "--config", path]).max_tokens == 5


@pytest.mark.parametrize("text, message", [
    ("max-num-seqs: 4\nmax-num-seq: 8\n", "unknown key 'max-num-seq' in the config file: pagoda serve has no --max-num-seq option"),
    ("quantization: int3\n", "invalid choice: 'int3'"),
    ("max-num-seqs: many\n", "invalid int value: 'many'"),
    ("compile: yes please\n", "key 'compile' in the config file is an on/off flag"),
    ("port: [1, 2]\n", "--port takes one value"),
    ("- max-num-seqs\n", "expected a mapping of flag names to values"),
])
def test_bad_files_are_errors_that_name_the_problem(tmp_path, capsys, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(SystemExit) as e:
        _parse(["serve", "--config", path])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_file_is_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _parse(["serve", "--config", str(tmp_path / "nope.yaml")])
    assert "nope.yaml" in capsys.readouterr().err
