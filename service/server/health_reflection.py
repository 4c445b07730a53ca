"""Health and reflection from the grpc libraries, with the two pieces they lack for grpc.aio.

- grpcio-health-checking's asyncio servicer inherits the generated stub's synchronous
  `List`, which grpc.aio cannot await (UNKNOWN and a TypeError in the log): `List` here
  answers from the same statuses that `Check` reads.
- grpcio-reflection serves only `grpc.reflection.v1alpha`; clients of the stable
  `grpc.reflection.v1` (newer grpcurl, Postman, grpcui) see nothing. The v1 protocol is
  the v1alpha one under another package name, so its descriptor is derived from the
  library's, and the library's servicer answers both.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

REFLECTION_V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
_REFLECTION_V1_FILE = "grpc/reflection/v1/reflection.proto"


class HealthServicer(health.aio.HealthServicer):
    """grpc_health's asyncio servicer, with `List`."""

    async def List(
        self, request: health_pb2.HealthListRequest, context
    ) -> health_pb2.HealthListResponse:
        return health_pb2.HealthListResponse(
            statuses={
                name: health_pb2.HealthCheckResponse(status=status)
                for name, status in self._server_status.items()
            }
        )


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Reflection v1alpha and v1 on `server`, listing `service_names` and both reflection
    services."""
    _add_reflection_v1_file()
    names = (*service_names, reflection.SERVICE_NAME, REFLECTION_V1_SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    # The same servicer's method under the v1 name: v1 messages have v1alpha's fields,
    # numbers and types, so the v1alpha classes read and write their bytes as they are.
    handler = grpc.stream_stream_rpc_method_handler(
        reflection.aio.ReflectionServicer(names).ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                REFLECTION_V1_SERVICE_NAME, {"ServerReflectionInfo": handler}
            ),
        )
    )


def _add_reflection_v1_file() -> None:
    """grpc/reflection/v1/reflection.proto in the default pool (once), so that reflection
    describes the v1 service too: v1alpha's file with the package renamed."""
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_REFLECTION_V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    proto.name, proto.package = _REFLECTION_V1_FILE, "grpc.reflection.v1"
    proto.ClearField("options")
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):
                field.type_name = field.type_name.replace(old, new)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new)
            method.output_type = method.output_type.replace(old, new)
    pool.Add(proto)
