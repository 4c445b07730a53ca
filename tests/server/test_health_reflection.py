"""Health/List is answered; reflection is served as v1alpha and as v1 (raw stubs of each,
as grpcurl and other clients call them)."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from .wire import RPC_TIMEOUT_SECONDS

SCHEDULER = "lattice.scheduler.v1.Scheduler"
REFLECTION_METHODS = {
    "v1alpha": "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "v1": "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
}


def test_health_list_answers_every_service_with_its_status(server):
    answer = health_pb2_grpc.HealthStub(server.channel).List(
        health_pb2.HealthListRequest(), timeout=RPC_TIMEOUT_SECONDS
    )
    statuses = {name: response.status for name, response in answer.statuses.items()}
    assert statuses == {
        "": health_pb2.HealthCheckResponse.SERVING,
        SCHEDULER: health_pb2.HealthCheckResponse.SERVING,
    }


def _reflect(
    channel: grpc.Channel, version: str, *requests: reflection_pb2.ServerReflectionRequest
):
    """Raw stream of one reflection version: v1's messages are v1alpha's bytes."""
    call = channel.stream_stream(
        REFLECTION_METHODS[version],
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    return list(call(iter(requests), timeout=RPC_TIMEOUT_SECONDS))


@pytest.mark.parametrize("version", ["v1alpha", "v1"])
def test_reflection_lists_the_services_in_both_versions(server, version):
    (answer,) = _reflect(
        server.channel, version, reflection_pb2.ServerReflectionRequest(list_services="")
    )
    names = {s.name for s in answer.list_services_response.service}
    assert {
        SCHEDULER,
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    } <= names


@pytest.mark.parametrize("version", ["v1alpha", "v1"])
@pytest.mark.parametrize(
    "symbol, package",
    [
        (SCHEDULER, "lattice.scheduler.v1"),
        ("grpc.reflection.v1.ServerReflection", "grpc.reflection.v1"),
    ],
)
def test_reflection_describes_a_symbol_in_both_versions(server, version, symbol, package):
    (answer,) = _reflect(
        server.channel,
        version,
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol),
    )
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(data)
        for data in answer.file_descriptor_response.file_descriptor_proto
    ]
    assert answer.WhichOneof("message_response") == "file_descriptor_response", answer
    described = next(f for f in files if f.package == package)
    service_name = symbol.rsplit(".", 1)[1]
    assert service_name in {s.name for s in described.service}
