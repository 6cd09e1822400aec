"""Fuzz the gRPC family of a pagoda server (`pagoda serve --grpc-port`): messages generated from
the service's own descriptors, every field at random (out-of-range numbers, NaN, long and odd
strings, long repeated fields, each arm of a oneof), sent to every RPC.

A case fails when the server answers INTERNAL or UNKNOWN (its 5xx), or does not answer in time;
any other status (INVALID_ARGUMENT, NOT_FOUND, ...) is a refusal, which is right for bad input.
"""

from __future__ import annotations

import time

import grpc
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from hypothesis import seed as hypothesis_seed

from fuzz_report import FuzzReport
from pagoda.entrypoints.grpc_api import pagoda_pb2 as pb, pagoda_pb2_grpc as pb_grpc

SERVER_FAULTS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED,
                 grpc.StatusCode.UNAVAILABLE}
# Fields that set how much a case generates, capped so a case stays cheap (still present, so
# their validation is exercised).
CAPS = {"max_tokens": 4, "min_tokens": 2}
_SCALARS = {
    FieldDescriptor.TYPE_INT32: st.integers(-2**31, 2**31 - 1), FieldDescriptor.TYPE_INT64: st.integers(-2**63, 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: st.integers(0, 2**32 - 1), FieldDescriptor.TYPE_UINT64: st.integers(0, 2**64 - 1),
    FieldDescriptor.TYPE_FLOAT: st.floats(width=32), FieldDescriptor.TYPE_DOUBLE: st.floats(),
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_STRING: st.text(max_size=40) | st.sampled_from(["", "{}", "[]", '{"type": "object"}', "[0-9"]),
    FieldDescriptor.TYPE_BYTES: st.binary(max_size=64),  # ChatMessage.images: encoded image files
}


def _value(field: FieldDescriptor, depth: int) -> st.SearchStrategy:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return message_strategy(field.message_type, depth + 1)
    strategy = _SCALARS[field.type]
    if field.name == "role":  # mostly real roles, so chats get past the first check
        strategy = st.sampled_from(["user", "assistant", "system"]) | strategy
    if field.name in CAPS:
        strategy = st.integers(0, CAPS[field.name])
    return strategy


def message_strategy(descriptor, depth: int = 0) -> st.SearchStrategy:
    """Messages of this descriptor's type with any subset of its fields set (one arm per oneof)."""
    optional = {}
    for field in descriptor.fields:
        if field.type == FieldDescriptor.TYPE_MESSAGE and depth >= 3:
            continue
        value = _value(field, depth)
        optional[field.name] = st.lists(value, max_size=8) if field.is_repeated else value

    def build(values: dict):
        message = descriptor._concrete_class()
        for oneof in descriptor.oneofs:  # at most one arm set, as the wire allows
            for extra in [f.name for f in oneof.fields if f.name in values][1:]:
                values.pop(extra)
        for name, value in values.items():
            field = descriptor.fields_by_name[name]
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                (getattr(message, name).extend(value) if field.is_repeated else getattr(message, name).CopyFrom(value))
            elif field.is_repeated:
                getattr(message, name).extend(value)
            else:
                setattr(message, name, value)
        return message

    return st.fixed_dictionaries({}, optional=optional).map(build)


def _sampling_capped(request) -> None:
    """A generated request generates little however its options came out."""
    sampling = getattr(request, "sampling", None)
    if sampling is not None and (not sampling.HasField("max_tokens") or sampling.max_tokens > CAPS["max_tokens"]):
        sampling.max_tokens = CAPS["max_tokens"]


def _runner(call, route: str, streams: bool, input_type, report: FuzzReport, cases: int, seed: int | None,
            timeout: float, metadata):
    @settings(max_examples=cases, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(request=message_strategy(input_type))
    def run(request) -> None:
        _sampling_capped(request)
        try:
            answer = call(request, timeout=timeout, metadata=metadata)
            if streams:
                list(answer)
            report.record(route, "OK")
        except grpc.RpcError as e:
            code = e.code()
            report.record(route, code.name, f"{code.name} {e.details()!r} for {str(request)[:300]!r}"
                          if code in SERVER_FAULTS else None)

    return hypothesis_seed(seed)(run) if seed is not None else run


def fuzz_grpc(target: str, cases: int, seed: int | None = None, api_key: str | None = None,
              timeout: float = 60.0) -> FuzzReport:
    """`cases` generated requests per RPC of pagoda.Engine (see pagoda.proto)."""
    report = FuzzReport()
    start = time.monotonic()
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    service = pb.DESCRIPTOR.services_by_name["Engine"]
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.EngineStub(channel)
        for method in service.methods:
            _runner(getattr(stub, method.name), f"grpc {method.name}", method.server_streaming, method.input_type,
                    report, cases, seed, timeout, metadata)()
    report.seconds = time.monotonic() - start
    return report
