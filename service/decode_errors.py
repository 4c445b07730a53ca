"""Requests whose bytes do not parse get INVALID_ARGUMENT, answered here, not by grpc.

Left to itself, grpc (1.85) answers such a request with INTERNAL "Exception
deserializing request!", logs a traceback at ERROR, and keeps about 16 KiB of the call
for the life of the process: a client sending garbage grows the server without bound
(measured by tests/fuzz/test_memory.py). Handlers here get a deserializer that never
raises; the call is then refused like any other invalid request.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc


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


def _refuse(request: _Undecodable, context: grpc.ServicerContext, method: str):
    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                  f"the request to {method} does not parse: {request.reason}")


def _unary_request(behavior, method: str):
    def checked(request, context):
        if isinstance(request, _Undecodable):
            _refuse(request, context, method)
        return behavior(request, context)
    return checked


def _stream_request(behavior, method: str):
    def checked(request_iterator: Iterator, context):
        def parsed() -> Iterator:
            for request in request_iterator:
                if isinstance(request, _Undecodable):
                    _refuse(request, context, method)
                yield request
        return behavior(parsed(), context)
    return checked


_KINDS = (
    ("unary_unary", grpc.unary_unary_rpc_method_handler, _unary_request),
    ("unary_stream", grpc.unary_stream_rpc_method_handler, _unary_request),
    ("stream_unary", grpc.stream_unary_rpc_method_handler, _stream_request),
    ("stream_stream", grpc.stream_stream_rpc_method_handler, _stream_request),
)


class DecodeErrorInterceptor(grpc.ServerInterceptor):
    """Answers undecodable requests with INVALID_ARGUMENT, for every service.

    Put it first among the interceptors, so a request is parsed before any check runs
    on it, as grpc itself does.
    """

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        for kind, factory, wrap in _KINDS:
            behavior = getattr(handler, kind)
            if behavior is not None:
                return factory(wrap(behavior, handler_call_details.method),
                               request_deserializer=_tolerant(handler.request_deserializer),
                               response_serializer=handler.response_serializer)
        return handler
