"""How the model is sharded over ranks: ``EngineArgs``' parallel knobs resolved (the backend
from the size, the rendezvous from the environment where the flags leave it open), and the check
that a model's shapes split over ``tensor_parallel_size`` ranks."""

from __future__ import annotations

import os
from dataclasses import dataclass

from pagoda.engine_args import EngineArgs

_ARGS = EngineArgs()


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is sharded over ranks (EngineArgs' parallel knobs, resolved)."""

    tensor_parallel_size: int = _ARGS.tensor_parallel_size
    backend: str = "uni"  # uni (one rank, in this process), mp (worker processes) or ray
    nnodes: int = _ARGS.nnodes
    node_rank: int = _ARGS.node_rank
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port, chosen at start-up
    timeout_seconds: float = _ARGS.distributed_timeout_seconds  # a collective that takes longer fails the engine

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size


def parallel_config(args: EngineArgs) -> ParallelConfig:
    """The parallel knobs resolved: the backend from the size, the rendezvous from the environment
    where the flags leave it open (the port stays None: chosen free at start-up)."""
    tp = args.tensor_parallel_size
    port = args.master_port
    if port is None and os.environ.get("MASTER_PORT"):
        port = _env_port(os.environ["MASTER_PORT"])
    return ParallelConfig(
        tensor_parallel_size=tp,
        backend=args.distributed_executor_backend or ("uni" if tp == 1 else "mp"),
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1",
        master_port=port,
        timeout_seconds=args.distributed_timeout_seconds,
    )


def _env_port(value: str) -> int:
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise ValueError(f"MASTER_PORT must be a port number in [1, 65535], got {value!r}")
    return int(value)


def check_tensor_parallel(tp: int, hf_config: dict) -> None:
    """Each rank holds 1/tp of the attention heads and of the MLP; KV heads are split, or
    replicated when there are fewer of them than ranks."""
    if tp == 1:
        return
    if isinstance(hf_config.get("vision_config"), dict):  # (the ranks' shard plan knows no vision tower)
        raise ValueError(f"tensor_parallel_size={tp}: a vision-language model runs on one rank")
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    intermediate = hf_config["intermediate_size"]
    if heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's {heads} attention heads")
    if intermediate % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's intermediate_size={intermediate}")
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's {kv_heads} key-value heads, "
                         "or be a multiple of them")
