"""Regenerate the Python stubs from pagoda.proto (grpcio-tools; a developer's step: the stubs are
shipped in the package, so users need only grpcio and protobuf)."""

from __future__ import annotations

from pathlib import Path


def main() -> int:
    from grpc_tools import protoc  # deferred: grpc_tools loads on first use

    root = Path(__file__).resolve().parents[3]  # the directory holding the `pagoda` package
    proto = Path(__file__).with_name("pagoda.proto").relative_to(root)
    return protoc.main(["protoc", f"-I{root}", f"--python_out={root}", f"--grpc_python_out={root}", str(proto)])


if __name__ == "__main__":
    raise SystemExit(main())
