"""A typed client of the scheduler for workers: deadlines on every call, retry with backoff.

Iterations go over one WorkerSession stream by default (`session=False`: unary SelectBatch
calls, as before sessions existed). A request that asks for a long poll (`idle_wait_ms`)
gets that much longer to be answered.

Retries cover the scheduler being unavailable (restarting, not yet up): UNAVAILABLE and
DEADLINE_EXCEEDED are retried with exponential backoff until `retry_seconds` run out.
FAILED_PRECONDITION (lease lost, scheduler restarted) surfaces as `NotRegistered` so the
caller drops what it holds and registers again, unless the scheduler says this incarnation
was superseded (another process registered the same worker_id since): that is `Superseded`,
and the caller must stop rather than register again and fight over the id. Other errors
surface as `SchedulerCallError`.

`stop` (the worker's stop event) ends every wait within a second: a retry's backoff, a call
in flight (cancelled), a session's answer; the call then raises `Stopped`. A call made after
the stop (leaving: the last report, DeregisterWorker) gets one try of at most a second.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass

import grpc

from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from worker_client import convert
from worker_client.resources import WorkerResources  # (tests import it from here too)
from worker_client.session import WorkerSessionStream

log = logging.getLogger(__name__)

# CANCELLED, for a call this client did not cancel: the scheduler went away mid-call.
_RETRYABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
)


class SchedulerCallError(Exception):
    """A call failed for good; `code` is the gRPC status code."""

    def __init__(self, method: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{method}: {code.name}: {details}")
        self.code = code


class NotRegistered(SchedulerCallError):
    """The scheduler does not know this worker (any more): register again."""


class Superseded(SchedulerCallError):
    """Another process registered this worker_id after us: stop, do not register again."""


class Stopped(SchedulerCallError):
    """The worker's stop event was set while this call waited (retrying or in flight)."""


# How long a wait may go on after the stop event is set; and how often a call in flight
# looks at the event.
_STOPPING_SECONDS = 1.0
_POLL_SECONDS = 0.1


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter: initial, doubling up to max, for at most total seconds."""

    initial_seconds: float = 0.05
    max_seconds: float = 2.0
    total_seconds: float = 60.0


class SchedulerClient:
    """One worker's connection to the scheduler."""

    def __init__(
        self,
        target: str,
        *,
        call_timeout_seconds: float = 5.0,
        retry: RetryPolicy = RetryPolicy(),
        stop: threading.Event | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
        session: bool = True,
    ) -> None:
        """`target`: HOST:PORT, or several replicas' HOST:PORT,HOST:PORT: the worker talks
        to one and moves to the next on UNAVAILABLE (`num_moves` counts the moves).
        `credentials`: TLS (None: plaintext); `token`: sent as `authorization: Bearer`;
        `session`: iterate over one WorkerSession stream (False: unary SelectBatch)."""
        self.targets = [part.strip() for part in target.split(",") if part.strip()]
        self._index = 0
        self.num_moves = 0
        self._credentials = credentials
        # gRPC's own reconnect backoff grows to 120 s by default: after a long outage the
        # channel would sit out a restarted scheduler for minutes while our retries fail
        # fast. Cap it at our retry backoff instead.
        self._options = [
            ("grpc.initial_reconnect_backoff_ms", max(1, int(retry.initial_seconds * 1000))),
            ("grpc.max_reconnect_backoff_ms", max(1, int(retry.max_seconds * 1000))),
        ]
        self._connect()
        # Keyword arguments of every call: the token's metadata, when there is one.
        self._call_options = {"metadata": (("authorization", f"Bearer {token}"),)} if token else {}
        self._timeout = call_timeout_seconds
        self._retry = retry
        self._stop = stop or threading.Event()
        self.uses_session = session
        self._session: WorkerSessionStream | None = None
        # The incarnation of our latest registration, sent with every later call (0: none
        # yet, which the scheduler reads as "the latest").
        self.incarnation = 0

    @property
    def target(self) -> str:
        """The replica this worker talks to now."""
        return self.targets[self._index]

    def close(self) -> None:
        self._end_session()
        self._channel.close()

    def _connect(self) -> None:
        target = self.target
        self._channel = (
            grpc.secure_channel(target, self._credentials, options=self._options)
            if self._credentials is not None
            else grpc.insecure_channel(target, self._options)
        )
        self._stub = pb_grpc.SchedulerStub(self._channel)

    def _move_on(self) -> None:
        """To the next replica of the list (after UNAVAILABLE); there, the worker must
        register again, and that replica takes over what it holds."""
        self._end_session()
        self._channel.close()
        self._index = (self._index + 1) % len(self.targets)
        self.num_moves += 1
        self._connect()
        log.warning("moving to the next scheduler replica", extra={"target": self.target})

    def register(self, resources: WorkerResources) -> pb.RegisterWorkerResponse:
        response = self._call(
            "RegisterWorker", self._stub.RegisterWorker, convert.register_request(resources)
        )
        self.incarnation = response.incarnation
        return response

    def select(self, request: pb.SelectBatchRequest) -> pb.SchedulerDecision:
        """One iteration's report and decision, as our latest incarnation (set on
        `request`), over the session unless it is off."""
        request.incarnation = self.incarnation
        timeout = self._timeout + request.idle_wait_ms / 1000
        if self.uses_session:
            return self._call("WorkerSession", self._exchange, request, timeout)
        return self._call("SelectBatch", self._stub.SelectBatch, request, timeout)

    def deregister(self, worker_id: str) -> int:
        """Leave; returns how many sequences went back to the queue."""
        self._end_session()
        response = self._call(
            "DeregisterWorker",
            self._stub.DeregisterWorker,
            convert.deregister_request(worker_id, self.incarnation),
        )
        return response.requeued

    def _exchange(
        self,
        request: pb.SelectBatchRequest,
        timeout: float,
        stop: threading.Event | None = None,
        **_call_options,
    ):
        if self._session is None:
            self._session = WorkerSessionStream(self._stub, **self._call_options)
        try:
            return self._session.exchange(request, timeout, stop=stop)
        except grpc.RpcError:
            self._session = None  # closed by now; the next try opens a new one
            raise

    def _end_session(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    def _call(self, method: str, fn, request, timeout: float | None = None):
        delay = self._retry.initial_seconds
        give_up_at = time.monotonic() + self._retry.total_seconds
        leaving = self._stop.is_set()  # one short try, nothing to interrupt
        timeout = timeout or self._timeout
        while True:
            try:
                if leaving:
                    return fn(
                        request, timeout=min(timeout, _STOPPING_SECONDS), **self._call_options
                    )
                return self._interruptible(method, fn, request, timeout)
            except grpc.RpcError as err:
                code = err.code()
                if not leaving and self._stop.is_set():
                    raise Stopped(method, code, "the worker is stopping") from None
                if code is grpc.StatusCode.FAILED_PRECONDITION:
                    # docs/contract.md, "Errors": an older incarnation's message starts so.
                    superseded = (err.details() or "").startswith("superseded:")
                    raise (Superseded if superseded else NotRegistered)(
                        method, code, err.details()
                    ) from None
                if leaving or code not in _RETRYABLE or time.monotonic() + delay > give_up_at:
                    raise SchedulerCallError(method, code, err.details()) from None
                if code is grpc.StatusCode.UNAVAILABLE and len(self.targets) > 1:
                    self._move_on()
                    if method != "WorkerSession":  # a session opens on the new stub
                        fn = getattr(self._stub, method)
                log.warning(
                    "scheduler call failed; retrying",
                    extra={
                        "method": method,
                        "code": code.name,
                        "retry_in_seconds": round(delay, 3),
                    },
                )
                if self._stop.wait(delay * (0.5 + random.random() / 2)):
                    raise Stopped(method, code, "the worker is stopping") from None
                delay = min(delay * 2, self._retry.max_seconds)

    def _interruptible(self, method: str, fn, request, timeout: float):
        """`fn(request)`, cancelled when the stop event is set (a unary call runs as a
        future; the session's exchange watches the event itself)."""
        if method == "WorkerSession":
            return fn(request, timeout=timeout, stop=self._stop, **self._call_options)
        if not hasattr(fn, "future"):  # not a stub's method (a test's stand-in)
            return fn(request, timeout=timeout, **self._call_options)
        future = fn.future(request, timeout=timeout, **self._call_options)
        while not future.done():
            if self._stop.wait(_POLL_SECONDS):
                future.cancel()
                raise Stopped(method, grpc.StatusCode.CANCELLED, "the worker is stopping")
        return future.result()
