"""Requests whose bytes do not parse get INVALID_ARGUMENT, answered here, not by grpc.

Left to itself, grpc (1.85) answers such a request with INTERNAL "Exception
deserializing request!", logs a traceback at ERROR, and keeps about 16 KiB of the call
for the life of the process: a client sending garbage grows the server without bound
(measured by tests/fuzz/test_memory.py). Handlers here get a deserializer that never
raises; the call is then refused like any other invalid request. A string field that is
not valid UTF-8 (a lone surrogate, a cut character) is named in the refusal.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from service.server.interceptors import handlers


class _Undecodable:
    """Stands in for a request whose bytes did not parse."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _tolerant(deserialize: Callable[[bytes], object]) -> Callable[[bytes], object]:
    descriptor = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)

    def deserialize_or_mark(data: bytes) -> object:
        try:
            return deserialize(data)
        except Exception as err:  # noqa: BLE001 - DecodeError, or whatever a parser raises
            field_path = bad_utf8_field(descriptor, data) if descriptor is not None else None
            if field_path is not None:
                return _Undecodable(f"{field_path} is not valid UTF-8 (a {descriptor.full_name})")
            return _Undecodable(str(err)[:300])

    return deserialize_or_mark


def bad_utf8_field(descriptor: Descriptor, data: bytes) -> str | None:
    """The path (`finished[0].error_message`) of the first string field of `data`, a
    serialized `descriptor` message, whose bytes are not UTF-8; None if none is (or the
    bytes are damaged otherwise)."""
    try:
        return _bad_utf8_in(descriptor, memoryview(data))
    except (IndexError, ValueError):
        return None


def _bad_utf8_in(descriptor: Descriptor, data: memoryview) -> str | None:
    counts: dict[int, int] = {}
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, pos = _varint(data, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            size, pos = _varint(data, pos)
            value, pos = data[pos : pos + size], pos + size
            if pos > len(data):
                raise ValueError("truncated")
            field = descriptor.fields_by_number.get(number)
            if field is None:
                continue
            index = counts.get(number, 0)
            counts[number] = index + 1
            name = field.name + (f"[{index}]" if field.is_repeated else "")
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    str(value, "utf-8")
                except UnicodeDecodeError:
                    return name
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                inner = _bad_utf8_in(field.message_type, value)
                if inner is not None:
                    return f"{name}.{inner}"
        else:  # groups (proto2) or damage: nothing to name
            raise ValueError(f"wire type {wire_type}")
    return None


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    """Answers undecodable requests with INVALID_ARGUMENT, for every service.

    Put it first among the interceptors, so a request is parsed before any check runs
    on it, as grpc itself does.
    """

    def __init__(self) -> None:
        self._wrapped = handlers.PerMethod()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        return self._wrapped.get(method, handler, lambda: _refusing_undecodable(handler, method))


def _refusing_undecodable(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    async def refuse_undecodable(request, context) -> None:
        if isinstance(request, _Undecodable):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the request to {method} does not parse: {request.reason}",
            )

    return handlers.wrap(
        handler,
        on_request=refuse_undecodable,
        request_deserializer=_tolerant(handler.request_deserializer),
    )
