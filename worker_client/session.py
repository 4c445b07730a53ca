"""One `WorkerSession` stream, used in lockstep: send a report, wait for its decision.

The scheduler answers each request with exactly one decision, in order, so one request
in flight at a time needs no matching. A session that fails (or is ended by the
scheduler, or gives no answer in time) is closed for good: the caller opens a new one and
sends the same report again (its token offsets make the retry safe).
"""

from __future__ import annotations

import queue
import threading
import time

import grpc

from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc

_END = object()
# How often a wait for an answer looks at the stop event.
_POLL_SECONDS = 0.1


class SessionBroken(grpc.RpcError):
    """The session ended without an answer: the server closed it, or time ran out."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class WorkerSessionStream:
    """A WorkerSession call; `exchange` one request at a time, from one thread."""

    def __init__(self, stub: pb_grpc.SchedulerStub, **call_options) -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._call = stub.WorkerSession(iter(self._requests.get, _END), **call_options)
        self._broken: grpc.RpcError | None = None
        threading.Thread(target=self._read, name="worker-session", daemon=True).start()

    def _read(self) -> None:
        try:
            for decision in self._call:
                self._answers.put(decision)
            self._answers.put(
                SessionBroken(grpc.StatusCode.UNAVAILABLE, "the scheduler ended the session")
            )
        except grpc.RpcError as err:
            self._answers.put(err)

    def exchange(
        self,
        request: pb.SelectBatchRequest,
        timeout_seconds: float,
        *,
        stop: threading.Event | None = None,
    ) -> pb.SchedulerDecision:
        """The decision for `request`; raises grpc.RpcError (the session is then closed),
        CANCELLED within a tenth of a second of `stop` being set."""
        if self._broken is not None:
            raise self._broken
        self._requests.put(request)
        answer = self._answer(time.monotonic() + timeout_seconds, timeout_seconds, stop)
        if isinstance(answer, pb.SchedulerDecision):
            return answer
        self._broken = answer
        self.close()
        raise answer

    def _answer(self, deadline: float, timeout_seconds: float, stop: threading.Event | None):
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return SessionBroken(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout_seconds:g} s"
                )
            if stop is not None and stop.is_set():
                return SessionBroken(grpc.StatusCode.CANCELLED, "the worker is stopping")
            try:
                return self._answers.get(timeout=min(left, _POLL_SECONDS))
            except queue.Empty:
                continue

    def close(self) -> None:
        """End the stream (the scheduler sees the worker leave the session, not the lease)."""
        self._requests.put(_END)
        self._call.cancel()
