"""Wrapping grpc.aio method handlers, for the interceptors (auth, decode errors, limits).

A wrapped handler runs `on_start(context)` before the call's behavior, and
`on_request(request, context)` on every request it reads (the one request of a unary-request
call, each message of a request stream). Either may end the call with `context.abort`.
The wrapper keeps the kind of the behavior it wraps: grpc.aio runs an async generator as a
response stream and a coroutine as a call that answers, or writes, by itself.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

OnStart = Callable[[grpc.aio.ServicerContext], Awaitable[None]]
OnRequest = Callable[[object, grpc.aio.ServicerContext], Awaitable[None]]

_FACTORIES = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


class PerMethod:
    """Wrapped handlers kept per method, so that a wrapper is built once, not per call.

    Keyed by method name (only methods that have a handler: a bounded set), and rebuilt
    when the handler to wrap is another object than last time (an inner interceptor that
    wraps per call, such as auth's), so the map never grows past the service's methods.
    """

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def get(
        self,
        method: str,
        handler: grpc.RpcMethodHandler,
        build: Callable[[], grpc.RpcMethodHandler],
    ) -> grpc.RpcMethodHandler:
        known = self._wrapped.get(method)
        if known is None or known[0] is not handler:
            known = self._wrapped[method] = (handler, build())
        return known[1]


def wrap(
    handler: grpc.RpcMethodHandler,
    *,
    on_start: OnStart | None = None,
    on_request: OnRequest | None = None,
    request_deserializer: Callable[[bytes], object] | None = None,
) -> grpc.RpcMethodHandler:
    """`handler` with the checks added (and another request deserializer, if given)."""
    for kind, factory in _FACTORIES.items():
        behavior = getattr(handler, kind)
        if behavior is not None:
            streaming_requests = kind.startswith("stream")
            wrapped = _wrap_behavior(behavior, on_start, on_request, streaming_requests)
            deserializer = request_deserializer or handler.request_deserializer
            return factory(
                wrapped,
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler


def _wrap_behavior(
    behavior, on_start: OnStart | None, on_request: OnRequest | None, streaming_requests: bool
):
    async def prepare(request_or_iterator, context):
        if on_start is not None:
            await on_start(context)
        if on_request is None:
            return request_or_iterator
        if streaming_requests:
            return _checked_requests(request_or_iterator, context, on_request)
        await on_request(request_or_iterator, context)
        return request_or_iterator

    if inspect.isasyncgenfunction(behavior):

        async def stream(request_or_iterator, context):
            argument = await prepare(request_or_iterator, context)
            async with contextlib.aclosing(behavior(argument, context)) as responses:
                async for response in responses:
                    yield response

        return stream
    if inspect.iscoroutinefunction(behavior):

        async def call(request_or_iterator, context):
            argument = await prepare(request_or_iterator, context)
            return await behavior(argument, context)

        return call
    raise TypeError(f"{behavior!r}: only async handlers are served (grpc.aio)")


async def _checked_requests(requests: AsyncIterator, context, on_request: OnRequest):
    async for request in requests:
        await on_request(request, context)
        yield request
