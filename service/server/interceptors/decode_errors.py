"""Requests whose bytes do not parse get INVALID_ARGUMENT, answered here, not by grpc.

Left to itself, grpc (1.85) answers such a request with INTERNAL "Exception
deserializing request!", logs a traceback at ERROR, and keeps about 16 KiB of the call
for the life of the process: a client sending garbage grows the server without bound
(measured by tests/fuzz/test_memory.py). Handlers here get a deserializer that never
raises; the call is then refused like any other invalid request.
"""
from __future__ import annotations

from collections.abc import Callable

import grpc

from service.server.interceptors import handlers


class _Undecodable:
    """Stands in for a request whose bytes did not parse."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _tolerant(deserialize: Callable[[bytes], object]) -> Callable[[bytes], object]:
    def deserialize_or_mark(data: bytes) -> object:
        try:
            return deserialize(data)
        except Exception as err:  # noqa: BLE001 - DecodeError, or whatever a parser raises
            return _Undecodable(str(err)[:300])
    return deserialize_or_mark


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
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the request to {method} does not parse: {request.reason}")

    return handlers.wrap(handler, on_request=refuse_undecodable,
                         request_deserializer=_tolerant(handler.request_deserializer))
