"""Helpers for talking to a scheduler over the wire: a fake worker, submits, waits."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import grpc
import pytest

from common.waiting import wait_until
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from worker_client.session import WorkerSessionStream

# Every RPC a test makes is bounded by this; a hung server fails the test, not the run.
RPC_TIMEOUT_SECONDS = 5.0
# How a fake worker sends its reports: unary SelectBatch calls, or one WorkerSession stream.
TRANSPORTS = ("unary", "session")


class Worker:
    """A fake worker that speaks the wire protocol: register, report, read decisions.

    `transport` "session" sends each report over one WorkerSession stream (reopened after
    an error ends it); "unary" makes a SelectBatch call of each.
    """

    def __init__(
        self, stub: pb_grpc.SchedulerStub, worker_id: str = "w1", transport: str = "unary"
    ) -> None:
        assert transport in TRANSPORTS, transport
        self.stub = stub
        self.worker_id = worker_id
        self.transport = transport
        self._session: WorkerSessionStream | None = None

    def register(
        self,
        *,
        total_kv_pages: int = 1000,
        page_size: int = 16,
        total_gdn_slots: int = 64,
        max_batch_size: int = 0,
        adapters: tuple[str, ...] = (),
    ) -> pb.RegisterWorkerResponse:
        return self.stub.RegisterWorker(
            pb.RegisterWorkerRequest(
                worker_id=self.worker_id,
                total_kv_pages=total_kv_pages,
                page_size=page_size,
                total_gdn_slots=total_gdn_slots,
                max_batch_size=max_batch_size,
                adapters=list(adapters),
            ),
            timeout=RPC_TIMEOUT_SECONDS,
        )

    def select(
        self,
        *,
        waiting=(),
        running=(),
        kv_free_pages: int = 1000,
        gdn_free_slots: int = 64,
        finished=(),
        preempted=(),
        draining: bool = False,
        tokens: dict[int, list[int]] | None = None,
    ) -> pb.SchedulerDecision:
        """One SelectBatch. `finished` items are (seq_id, reason[, generated_tokens])."""
        return self.send(
            pb.SelectBatchRequest(
                worker_id=self.worker_id,
                waiting=list(waiting),
                running=list(running),
                kv_free_pages=kv_free_pages,
                gdn_free_slots=gdn_free_slots,
                finished=[
                    pb.FinishedSequence(
                        seq_id=f[0], reason=f[1], generated_tokens=f[2] if len(f) > 2 else 0
                    )
                    for f in finished
                ],
                preempted=list(preempted),
                draining=draining,
                tokens=[pb.TokenUpdate(seq_id=s, token_ids=t) for s, t in (tokens or {}).items()],
            )
        )

    def send(
        self, request: pb.SelectBatchRequest, timeout_seconds: float = RPC_TIMEOUT_SECONDS
    ) -> pb.SchedulerDecision:
        """One report as it is, over this worker's transport."""
        if self.transport == "unary":
            return self.stub.SelectBatch(request, timeout=timeout_seconds)
        if self._session is None:
            self._session = WorkerSessionStream(self.stub)
        try:
            return self._session.exchange(request, timeout_seconds)
        except grpc.RpcError:
            self._session = None  # the error ended it; the next report opens another
            raise

    def deregister(self) -> pb.DeregisterWorkerResponse:
        self.close()
        return self.stub.DeregisterWorker(
            pb.DeregisterWorkerRequest(worker_id=self.worker_id), timeout=RPC_TIMEOUT_SECONDS
        )

    def close(self) -> None:
        """End the session, if there is one (a worker leaving its stream, not the scheduler)."""
        if self._session is not None:
            self._session.close()
            self._session = None


def submit(
    stub: pb_grpc.SchedulerStub, prompt=(1, 2, 3), max_new_tokens: int = 4, **fields
) -> pb.SubmitResponse:
    return stub.Submit(
        pb.SubmitRequest(prompt_token_ids=list(prompt), max_new_tokens=max_new_tokens, **fields),
        timeout=RPC_TIMEOUT_SECONDS,
    )


def submit_many(stub: pb_grpc.SchedulerStub, count: int, **kwargs) -> list[int]:
    return [submit(stub, **kwargs).seq_id for _ in range(count)]


def get_sequence(stub: pb_grpc.SchedulerStub, seq_id: int) -> pb.SequenceInfo:
    return stub.GetSequence(pb.GetSequenceRequest(seq_id=seq_id), timeout=RPC_TIMEOUT_SECONDS)


def admitted(decision: pb.SchedulerDecision) -> list[int]:
    """Ids of the first chunks (admissions) in a decision, in order."""
    return [c.seq_id for c in decision.prefill if c.HasField("spec")]


def admit_until(worker: Worker, count: int, timeout: float = 20.0) -> list[int]:
    """The ids `worker` is given, in order, until it holds `count` (each call reports
    what it holds)."""
    got: list[int] = []

    def more() -> bool:
        got.extend(admitted(worker.select(running=got)))
        return len(got) >= count

    wait_until(more, f"{count} admissions on {worker.worker_id}", timeout)
    return got


def continued(decision: pb.SchedulerDecision) -> list[int]:
    """Ids of the continuation chunks in a decision, in order."""
    return [c.seq_id for c in decision.prefill if not c.HasField("spec")]


def rpc_error(call: Callable[[], object]) -> grpc.RpcError:
    """Run call(), which must fail with an RpcError; return the error."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


class Stream:
    """A Generate call read on a thread, so a test can wait for each event with a bound."""

    def __init__(
        self, stub: pb_grpc.SchedulerStub, request: pb.SubmitRequest, timeout_seconds: float = 20.0
    ) -> None:
        self.call = stub.Generate(request, timeout=timeout_seconds)
        self._events: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for event in self.call:
                self._events.put(event)
            self._events.put(StopIteration())
        except grpc.RpcError as err:
            self._events.put(err)

    def next(self, timeout_seconds: float = 5.0):
        """The next event; StopIteration() at the end of the stream, or the RpcError."""
        try:
            return self._events.get(timeout=timeout_seconds)
        except queue.Empty:
            pytest.fail(f"no Generate event within {timeout_seconds:g} s")

    def next_event(self, timeout_seconds: float = 5.0) -> pb.GenerateEvent:
        event = self.next(timeout_seconds)
        assert isinstance(event, pb.GenerateEvent), f"expected an event, got {event!r}"
        return event

    def rest(self, timeout_seconds: float = 5.0) -> list[pb.GenerateEvent]:
        """Every event up to the end of the stream (which must end normally)."""
        events = []
        while True:
            item = self.next(timeout_seconds)
            if isinstance(item, StopIteration):
                return events
            assert isinstance(item, pb.GenerateEvent), f"stream failed: {item!r}"
            events.append(item)

    def tokens_until(self, count: int, timeout_seconds: float = 5.0) -> list[int]:
        """Read events until `count` tokens arrived in all; fails on a finished event."""
        tokens: list[int] = []
        while len(tokens) < count:
            event = self.next_event(timeout_seconds)
            assert not event.finished, f"stream finished early after {tokens}"
            tokens += event.token_ids
        return tokens
