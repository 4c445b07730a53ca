"""The gRPC servicer (grpc.aio): each RPC converts, calls the core on the event loop,
converts back.

The core is synchronous and single-threaded; every call to it happens on the one event
loop, so calls never overlap and need no lock. What waits (a Generate stream for its
tokens, a worker parked in a long poll, a Submit for its fsync) awaits an event and costs
nothing while it waits.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

import grpc

from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from service.core import NotFound, Scheduler, SchedulerError, WorkerReport
from service.core.types import Decision, SubmitParams
from service.server import convert
from service.server.interceptors.auth import Callers
from service.server.loop_lag import LoopLag
from service.server.metrics import SchedulerMetrics
from service.server.running_lists import RunningLists
from service.server.status_codes import status_code, status_details
from service.server.wakeups import Wakeups

log = logging.getLogger(__name__)

# A parked long poll is answered well within the worker's lease, so that waiting for
# work never looks like silence (the fraction of lease_ttl_ms it may wait at most).
MAX_IDLE_WAIT_LEASE_FRACTION = 0.5


def rpc(method):
    """Map domain errors to status codes; anything else is INTERNAL, logged once."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except SchedulerError as err:
            await context.abort(status_code(err), status_details(err))
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception:  # the last line of defence for one RPC
            log.exception("internal error in %s", method.__name__)
            await context.abort(
                grpc.StatusCode.INTERNAL,
                f"internal error in {method.__name__}; see the scheduler log",
            )

    return wrapper


class SchedulerServicer(pb_grpc.SchedulerServicer):
    """Serves lattice.scheduler.v1.Scheduler over one core, on one event loop.

    `durable()` returns once every change that must survive a power loss is on disk
    (group commit: service/state/group_commit.py). What a client is told OK (Submit, Cancel,
    Generate's first event) awaits it; worker and admin calls too when
    `durable_worker_progress` (--state-fsync always). `lag` charges a stalled loop to
    SelectBatch's latency histogram. `callers` says whose a client call is (its token's
    principal): what it submits is that principal's, and it sees only that principal's
    sequences (admin, and a scheduler without tokens, see all).
    """

    def __init__(
        self,
        core: Scheduler,
        wakeups: Wakeups,
        *,
        metrics: SchedulerMetrics | None = None,
        lag: LoopLag | None = None,
        durable: Callable[[], Awaitable[None]] | None = None,
        durable_worker_progress: bool = False,
        callers: Callers | None = None,
    ) -> None:
        self._core = core
        self._callers = callers or Callers(None)
        self._wakeups = wakeups
        self._metrics = metrics
        self._lag = lag
        self._durable = durable or _nothing_to_wait_for
        self._durable_worker_progress = durable_worker_progress and durable is not None
        self._loop = asyncio.get_running_loop()
        # Set when the server stops: streams then end without cancelling their sequences.
        self._stopping = False
        # The tasks serving WorkerSession streams, ended when the server stops.
        self._sessions: set[asyncio.Task] = set()
        # Each worker's latest running list sent in full (reports may then leave it out).
        self._running_lists = RunningLists()

    def stop_streams_without_cancelling(self) -> None:
        """From now on a Generate stream that ends leaves its sequence alone (the server is
        going away, not the client: after a restart the client re-attaches); parked workers
        are answered, and worker sessions end after their current answer."""
        self._stopping = True
        self._wakeups.close()
        for task in self._sessions:
            task.cancel()  # the worker retries on a new session, on the next scheduler

    # ----------------------------------------------------------------- clients

    @rpc
    async def Submit(self, request, context):
        result = self._core.submit(self._submit_params(request, context))
        await self._durable()
        return convert.submit_response(result)

    @rpc
    async def Cancel(self, request, context):
        cancelled = self._core.cancel(request.seq_id, self._callers.caller(context))
        await self._durable()
        return pb.CancelResponse(cancelled=cancelled)

    @rpc
    async def GetSequence(self, request, context):
        return convert.sequence_info(
            self._core.get_sequence(request.seq_id, self._callers.caller(context))
        )

    @rpc
    async def GetStatus(self, request, context):
        return convert.status(self._core.status())

    async def Generate(self, request, context):
        """Submit, then stream tokens until the sequence finishes or the client leaves."""
        try:
            seq_id = self._core.submit(self._submit_params(request, context)).seq_id
        except SchedulerError as err:
            await context.abort(status_code(err), status_details(err))
        # A client that goes away cancels its sequence (a no-op once it has finished),
        # also while it waits for the fsync below.
        context.add_done_callback(
            lambda _context: self._loop.call_soon_threadsafe(self._cancel_quietly, seq_id)
        )
        try:
            await self._durable()
        except SchedulerError as err:
            await context.abort(status_code(err), status_details(err))
        yield convert.generate_event(seq_id)
        async for event in self._stream_output(seq_id, 0, context):
            yield event

    async def FollowSequence(self, request, context):
        """Stream a sequence's tokens from `start` on until it finishes; it submits nothing,
        and a caller that leaves cancels nothing."""
        try:
            self._core.get_sequence(request.seq_id, self._callers.caller(context))
        except SchedulerError as err:  # unknown, or another principal's
            await context.abort(status_code(err), status_details(err))
        async for event in self._stream_output(request.seq_id, request.start, context):
            yield event

    async def _stream_output(self, seq_id: int, sent: int, context):
        """`seq_id`'s output events from token `sent` on, as the core has it, to its end."""
        with self._wakeups.watching(seq_id) as changed:
            while True:
                changed.clear()
                try:
                    view = self._core.read_output(seq_id, sent)
                except SchedulerError as err:  # forgotten, long finished
                    await context.abort(status_code(err), status_details(err))
                if view.token_ids or view.finished:
                    sent += len(view.token_ids)
                    yield convert.output_event(seq_id, view)
                    if view.finished:
                        return
                else:
                    await changed.wait()

    def _submit_params(self, request, context) -> SubmitParams:
        """The request as its principal's, with the tenant its token is bound to, if any."""
        params = convert.submit_params(request)
        grant = self._callers.grant(context)
        if grant is None:
            return params
        return replace(
            params,
            principal=grant.principal,
            tenant=params.tenant if grant.tenant is None else grant.tenant,
        )

    def _cancel_quietly(self, seq_id: int) -> None:
        """The sequence of a Generate whose client left (the caller's own, by its id)."""
        if self._stopping:
            return
        try:
            self._core.cancel(seq_id)
        except NotFound:
            pass
        except SchedulerError:  # e.g. the store failed: the sequence runs on, logged
            log.exception("could not cancel seq_id %d after its client left", seq_id)

    # ----------------------------------------------------------------- workers

    @rpc
    async def RegisterWorker(self, request, context):
        settings = self._core.register_worker(convert.worker_registration(request))
        self._running_lists.forget(request.worker_id)
        await self._progress_durable()
        log.info(
            "worker registered",
            extra={"worker_id": request.worker_id, "incarnation": settings.incarnation},
        )
        return convert.worker_settings(settings)

    @rpc
    async def SelectBatch(self, request, context):
        return await self._select(request)

    async def WorkerSession(self, request_iterator, context):
        """SelectBatch over one stream: each request answered by one decision, in order.

        A domain error ends the session with its status (the worker opens a new one). When
        the server stops, the session ends after its current answer.
        """
        if self._stopping:
            return
        task = asyncio.current_task()
        self._sessions.add(task)
        try:
            async for request in request_iterator:
                try:
                    decision = await self._select(request)
                except SchedulerError as err:
                    await context.abort(status_code(err), status_details(err))
                yield decision
        finally:
            self._sessions.discard(task)

    @rpc
    async def DeregisterWorker(self, request, context):
        requeued = self._core.deregister_worker(convert.worker_id(request), request.incarnation)
        self._running_lists.forget(request.worker_id)
        await self._progress_durable()
        log.info(
            "worker deregistered", extra={"worker_id": request.worker_id, "requeued": requeued}
        )
        return pb.DeregisterWorkerResponse(requeued=requeued)

    @rpc
    async def DrainWorker(self, request, context):
        num_assigned = self._core.drain_worker(convert.worker_id(request), request.resume)
        if request.resume:
            self._wakeups.work_may_have_arrived()  # the worker may admit again
        await self._progress_durable()
        log.info(
            "worker drain lifted" if request.resume else "worker drained",
            extra={"worker_id": request.worker_id, "num_assigned": num_assigned},
        )
        return pb.DrainWorkerResponse(num_assigned=num_assigned)

    async def _select(self, request: pb.SelectBatchRequest) -> pb.SchedulerDecision:
        """One SelectBatch; a long poll when the worker asks for one and has nothing to do.

        The latency observed runs from the call's arrival (the loop's lateness included)
        to the answer, without the time parked waiting for work.
        """
        started = self._arrival()
        running = self._running_lists.running(request)
        if running is None:  # it named a running list this scheduler does not hold
            self._observe_duration(started)
            return convert.running_needed()
        report = convert.worker_report(request, running)
        decision = self._core.select_batch(report)
        wait_seconds = self._idle_wait_seconds(request, report, decision)
        if wait_seconds:
            give_up_at = time.perf_counter() + wait_seconds
            while _is_empty(decision) and (remaining := give_up_at - time.perf_counter()) > 0:
                if not await self._wakeups.wait_for_work(remaining):
                    break
                started = self._arrival()
                decision = self._core.select_batch(report)
        answer = self._running_lists.answer(request, running, decision)
        await self._answer_durable(request, started)
        self._observe_duration(started)
        return answer

    def _observe_duration(self, started: float) -> None:
        """SelectBatch's latency histogram: from `started` (its arrival) to now."""
        if self._metrics is not None:
            self._metrics.select_batch_duration.observe(time.perf_counter() - started)

    async def _answer_durable(self, request: pb.SelectBatchRequest, started: float) -> None:
        """Before a SelectBatch that arrived at `started` (perf_counter) answers (a replica's
        commit may wait for its answer_due_us)."""
        await self._progress_durable()

    async def _progress_durable(self) -> None:
        """Under --state-fsync always, wait for the fsync of worker and admin changes too."""
        if self._durable_worker_progress:
            await self._durable()

    def _idle_wait_seconds(
        self, request: pb.SelectBatchRequest, report: WorkerReport, decision: Decision
    ) -> float:
        """How long this call may park: only a worker with nothing held, nothing to report
        and nothing admitted, that asked for it; never near its lease. Not a report that
        asks to be decided later (its wake-ups would be deferred too)."""
        if (
            not request.idle_wait_ms
            or self._stopping
            or report.decide_later
            or report.draining
            or report.waiting
            or report.running
            or report.finished
            or report.preempted
            or report.tokens
            or report.token_runs.seq_ids
            or report.handoffs
            or not _is_empty(decision)
        ):
            return 0.0
        lease_seconds = self._core.config.lease_ttl_ms / 1000
        return min(request.idle_wait_ms / 1000, lease_seconds * MAX_IDLE_WAIT_LEASE_FRACTION)

    def _arrival(self) -> float:
        """When the call now starting arrived, at the latest as far as we can tell."""
        return time.perf_counter() - (self._lag.delay() if self._lag is not None else 0.0)

    # ----------------------------------------------------------------- the server's own

    def expire_leases(self) -> list[str]:
        """The sweeper's call: drop silent workers, and count what no worker can run."""
        dropped = self._core.expire_leases()
        for worker_id in dropped:
            log.warning(
                "worker lease expired; its sequences went back to the queue",
                extra={"worker_id": worker_id},
            )
        # Also the baselines of leases that expired during another worker's call.
        self._running_lists.keep_only(self._core.worker_ids())
        self._count_queued()
        return dropped

    def _count_queued(self) -> None:
        """lattice_scheduler_unservable_queued and fleet_queue_depth as of this sweep."""
        if self._metrics is not None:
            self._metrics.unservable_queued.set(self._core.num_unservable_queued())
            self._metrics.fleet_queue_depth.set(self._core.status().queue_depth)


def _is_empty(decision: Decision) -> bool:
    return not (
        decision.prefill
        or decision.decode
        or decision.evict
        or decision.preempt
        or decision.handoffs
    )


async def _nothing_to_wait_for() -> None:
    return None
