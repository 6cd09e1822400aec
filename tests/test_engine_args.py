"""EngineArgs is the one declaration of the engine's knobs: the CLI options come from its fields,
the config (scheduler and parallel knobs included) from its values, and bad values fail early with
the field named."""

from __future__ import annotations

import ast
import dataclasses
import json
import shutil
from pathlib import Path

import pytest

import pagoda
from pagoda.config import ParallelConfig, create_engine_config
from pagoda.engine_args import EngineArgs
from pagoda.cli import build_parser

ENGINE_COMMANDS = [["generate", "hi"], ["chat"], ["serve"]]


def _parse(argv: list[str]) -> EngineArgs:
    return EngineArgs.from_cli_args(build_parser().parse_args(argv))


def _subparser(name: str):
    (subparsers,) = [a for a in build_parser()._actions if a.dest == "command"]
    return subparsers.choices[name]


@pytest.mark.parametrize("command", [argv[0] for argv in ENGINE_COMMANDS])
def test_every_field_has_a_flag(command):
    options = {s for action in _subparser(command)._actions for s in action.option_strings}
    for f in dataclasses.fields(EngineArgs):
        if f.name != "extra":
            assert f"--{f.name.replace('_', '-')}" in options, f.name
    assert "--extra" not in options and "-tp" in options


@pytest.mark.parametrize("argv", ENGINE_COMMANDS)
def test_an_empty_command_gives_the_defaults(argv):
    assert _parse(argv) == EngineArgs()


def test_flags_reach_the_fields():
    args = _parse([
        "serve", "--model", "m", "--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "7",
        "--max-num-batched-tokens", "64", "--block-size", "32", "--kv-cache-memory", "0.5",
        "--gpu-memory-utilization", "0.5", "--seed", "3", "--chat-template", "t", "--enforce-eager", "--compile",
        "--no-enable-prefix-caching", "--deterministic", "--quantization", "none", "--device", "cpu",
        "--aging-seconds", "5", "--admission-pressure-threshold", "0.8", "--short-chunk-tokens", "16",
        "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray", "--nnodes", "2", "--node-rank", "1",
        "--master-addr", "10.0.0.1", "--master-port", "29500", "--distributed-timeout-seconds", "5",
    ])
    assert args == EngineArgs(
        model="m", dtype="float32", max_model_len=128, max_num_seqs=7, max_num_batched_tokens=64, block_size=32,
        kv_cache_memory=0.5, gpu_memory_utilization=0.5, seed=3, chat_template="t", enforce_eager=True, compile=True,
        enable_prefix_caching=False, deterministic=True, quantization="none", device="cpu", aging_seconds=5.0,
        admission_pressure_threshold=0.8, short_chunk_tokens=16, tensor_parallel_size=2,
        distributed_executor_backend="ray", nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29500,
        distributed_timeout_seconds=5.0,
    )
    assert _parse(["chat", "-tp", "4", "--no-deterministic"]) == EngineArgs(tensor_parallel_size=4, deterministic=False)


@pytest.mark.parametrize("argv", [
    ["serve", "--distributed-executor-backend", "mpi"],
    ["serve", "--quantization", "int3"],
    ["serve", "--tensor-parallel-size", "two"],
])
def test_the_parser_rejects_bad_values(argv):
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"aging_seconds": -1.0}, "aging_seconds must be >= 0"),
    ({"admission_pressure_threshold": 0.0}, r"admission_pressure_threshold must be in \(0, 1\]"),
    ({"admission_pressure_threshold": 1.5}, r"admission_pressure_threshold must be in \(0, 1\]"),
    ({"short_chunk_tokens": 0}, "short_chunk_tokens must be >= 1"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
    ({"nnodes": 0}, "nnodes must be >= 1"),
    ({"nnodes": 2, "node_rank": 2, "tensor_parallel_size": 2}, r"node_rank must be in \[0, nnodes=2\), got 2"),
    ({"node_rank": -1}, r"node_rank must be in \[0, nnodes=1\)"),
    ({"nnodes": 2, "tensor_parallel_size": 3}, "tensor_parallel_size must be divisible by nnodes=2, got 3"),
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"},
     "distributed_executor_backend must be mp or ray with tensor_parallel_size=2"),
    ({"distributed_executor_backend": "mpi"}, "distributed_executor_backend must be one of mp, ray, uni"),
    ({"master_port": 70000}, "master_port must be in"),
    ({"distributed_timeout_seconds": 0.0}, "distributed_timeout_seconds must be > 0"),
])
def test_bad_values_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        create_engine_config(EngineArgs(model="not-even-resolved", **kwargs))  # checked before the model


def test_scheduler_and_parallel_knobs_reach_the_config(tiny_llama, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    config = create_engine_config(EngineArgs(model=str(tiny_llama), aging_seconds=0.0, admission_pressure_threshold=0.5,
                        short_chunk_tokens=8, distributed_timeout_seconds=9.0))
    assert (config.scheduler.aging_seconds, config.scheduler.admission_pressure_threshold) == (0.0, 0.5)
    assert config.scheduler.short_chunk_tokens == 8
    assert config.parallel == ParallelConfig(timeout_seconds=9.0)
    assert (config.parallel.backend, config.parallel.world_size) == ("uni", 1)
    assert (config.parallel.master_addr, config.parallel.master_port) == ("127.0.0.1", None)


def test_the_backend_follows_the_size_and_the_rendezvous_the_environment(tiny_llama, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "29501")
    # 4 ranks over the tiny Llama's 2 KV heads: each KV head is replicated on 2 ranks
    parallel = create_engine_config(EngineArgs(model=str(tiny_llama), tensor_parallel_size=4)).parallel
    assert (parallel.backend, parallel.world_size) == ("mp", 4)
    assert (parallel.master_addr, parallel.master_port) == ("10.1.2.3", 29501)
    given = EngineArgs(model=str(tiny_llama), tensor_parallel_size=2, nnodes=2, node_rank=1,
                       distributed_executor_backend="ray", master_addr="10.9.9.9", master_port=1234)
    parallel = create_engine_config(given).parallel
    assert parallel == ParallelConfig(2, "ray", 2, 1, "10.9.9.9", 1234, 60.0)
    monkeypatch.setenv("MASTER_PORT", "http")
    with pytest.raises(ValueError, match="MASTER_PORT must be a port number"):
        create_engine_config(EngineArgs(model=str(tiny_llama)))


def _model_with(tiny_llama: Path, tmp_path: Path, **config_changes) -> str:
    out = tmp_path / "model"
    shutil.copytree(tiny_llama, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **config_changes}))
    return str(out)


@pytest.mark.parametrize(("changes", "tp", "message"), [
    ({}, 3, "tensor_parallel_size=3 must divide the model's 4 attention heads"),
    ({"intermediate_size": 130}, 4, "tensor_parallel_size=4 must divide the model's intermediate_size=130"),
    ({"num_attention_heads": 6, "num_key_value_heads": 3}, 2,
     "tensor_parallel_size=2 must divide the model's 3 key-value heads, or be a multiple of them"),
])
def test_tensor_parallel_size_must_fit_the_model(tiny_llama, tmp_path, changes, tp, message):
    with pytest.raises(ValueError, match=message):
        create_engine_config(EngineArgs(model=_model_with(tiny_llama, tmp_path, **changes), tensor_parallel_size=tp))


def _imports(path: Path) -> set[tuple[str, str]]:
    """(module, name) of each `from module import name` in the file, wherever it sits."""
    tree = ast.parse(path.read_text())
    return {(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            for alias in node.names}


def test_no_module_reaches_back_into_the_cli_or_the_catalog_for_home():
    root = Path(pagoda.__file__).parent
    for path in root.rglob("*.py"):
        imports = _imports(path)
        if path != root / "entrypoints" / "cli.py":
            assert not any(module == "pagoda.cli" for module, _ in imports), path
        assert ("pagoda.loader.catalog", "pagoda_home") not in imports, path
