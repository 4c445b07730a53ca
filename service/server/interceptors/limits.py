"""Caps on open streams, so that no number of clients can crowd the workers out.

Each open stream costs memory and, when it has something to send, time on the one event
loop that also answers the workers. Two pools, each with its own cap:

- `generate`: client `Generate` and `FollowSequence` streams (`--max-streams`; on
  replicas a FollowSequence is another replica relaying a client's Generate);
- `open`: streams of the services that need no token, `Health.Watch` and reflection
  (`--max-open-streams`): with tokens on, anyone who reaches the port can open these.

A stream beyond its pool's cap is refused at once with RESOURCE_EXHAUSTED, never queued.
Worker RPCs (RegisterWorker, SelectBatch, WorkerSession, DeregisterWorker) are in no pool.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc

from service.server.interceptors import handlers

GENERATE_METHODS = frozenset(
    {"/lattice.scheduler.v1.Scheduler/Generate", "/lattice.scheduler.v1.Scheduler/FollowSequence"}
)
OPEN_STREAM_METHODS = frozenset(
    {
        "/grpc.health.v1.Health/Watch",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    }
)


@dataclass
class StreamPool:
    """Streams of one kind open now, and how many may be."""

    kind: str  # a bounded metric label: "generate" or "open"
    max_streams: int
    refusal: str  # the status message of a refused stream
    num_open: int = 0


class StreamLimitInterceptor(grpc.aio.ServerInterceptor):
    """Counts open streams per pool and refuses those beyond its cap.

    `on_change(kind, num_open, refused)` is called after every admission, end and
    refusal (metrics).
    """

    def __init__(
        self,
        *,
        max_streams: int,
        max_open_streams: int,
        on_change: Callable[[str, int, bool], None] | None = None,
    ) -> None:
        generate = StreamPool(
            "generate",
            max_streams,
            f"this scheduler serves at most {max_streams} Generate streams at once "
            f"(--max-streams); retry later, or Submit and poll GetSequence",
        )
        open_streams = StreamPool(
            "open",
            max_open_streams,
            f"this scheduler serves at most {max_open_streams} Health.Watch and reflection "
            f"streams at once (--max-open-streams); retry later, or use Health.Check",
        )
        self._pools = {
            **dict.fromkeys(GENERATE_METHODS, generate),
            **dict.fromkeys(OPEN_STREAM_METHODS, open_streams),
        }
        self._on_change = on_change or (lambda kind, num_open, refused: None)
        self._wrapped = handlers.PerMethod()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        pool = self._pools.get(method)
        if handler is None or pool is None:
            return handler
        return self._wrapped.get(method, handler, lambda: self._admitting(handler, pool))

    def _admitting(self, handler: grpc.RpcMethodHandler, pool: StreamPool) -> grpc.RpcMethodHandler:
        async def admit(context) -> None:
            if pool.num_open >= pool.max_streams:
                self._on_change(pool.kind, pool.num_open, True)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, pool.refusal)
            pool.num_open += 1
            self._on_change(pool.kind, pool.num_open, False)
            context.add_done_callback(lambda _context: self._release(pool))

        return handlers.wrap(handler, on_start=admit)

    def _release(self, pool: StreamPool) -> None:
        pool.num_open -= 1
        self._on_change(pool.kind, pool.num_open, False)


WORKER_METHODS = frozenset({"RegisterWorker", "SelectBatch", "WorkerSession", "DeregisterWorker"})


class WorkerPortInterceptor(grpc.aio.ServerInterceptor):
    """On the separate worker listener (--worker-port): the worker RPCs and health only."""

    def __init__(self, port: int) -> None:
        self._refusal = (
            f"port {port} (--worker-port) serves only the worker RPCs "
            f"({', '.join(sorted(WORKER_METHODS))}) and health; clients call "
            f"the main port (--port)"
        )

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        service, _, method = handler_call_details.method.lstrip("/").rpartition("/")
        if (
            handler is None
            or service == "grpc.health.v1.Health"
            or (service == "lattice.scheduler.v1.Scheduler" and method in WORKER_METHODS)
        ):
            return handler

        async def refuse(context) -> None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, self._refusal)

        return handlers.wrap(handler, on_start=refuse)
