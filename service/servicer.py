"""The gRPC servicer: each RPC converts, calls the core under one lock, converts back."""
from __future__ import annotations

import functools
import logging
import threading
import time

import grpc
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc

from service import convert
from service.core import NotFound, Scheduler, SchedulerError
from service.metrics import SchedulerMetrics
from service.status_codes import status_code, status_details

log = logging.getLogger(__name__)

# How often an idle Generate stream re-checks that its client is still there.
_STREAM_POLL_SECONDS = 0.25


def _unary(method):
    """Map domain errors to status codes; anything else is INTERNAL, logged once."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except SchedulerError as err:
            context.abort(status_code(err), status_details(err))
        except Exception:  # noqa: BLE001 - the last line of defence for one RPC
            log.exception("internal error in %s", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL,
                          f"internal error in {method.__name__}; see the scheduler log")

    return wrapper


class SchedulerServicer(pb_grpc.SchedulerServicer):
    """Serves lattice.scheduler.v1.Scheduler over one core, serialized by one condition."""

    def __init__(self, core: Scheduler, metrics: SchedulerMetrics | None = None) -> None:
        self._core = core
        self._metrics = metrics
        # Guards the core; notified after every call so Generate streams see new tokens.
        self._changed = threading.Condition()
        # Set when the server stops: streams then end without cancelling their sequences.
        self._stopping = False

    def stop_streams_without_cancelling(self) -> None:
        """From now on a Generate stream that ends leaves its sequence alone: the server is
        going away, not the client (after a restart the client re-attaches)."""
        with self._changed:
            self._stopping = True

    def call(self, fn, *args):
        """Run fn(*args) on the core under the lock, then wake the streams."""
        with self._changed:
            result = fn(*args)
            self._changed.notify_all()
            return result

    @_unary
    def Submit(self, request, context):
        return convert.submit_response(self.call(self._core.submit,
                                                 convert.submit_params(request)))

    @_unary
    def Cancel(self, request, context):
        return pb.CancelResponse(cancelled=self.call(self._core.cancel, request.seq_id))

    @_unary
    def GetSequence(self, request, context):
        with self._changed:
            return convert.sequence_info(self._core.get_sequence(request.seq_id))

    @_unary
    def RegisterWorker(self, request, context):
        settings = self.call(self._core.register_worker, convert.worker_registration(request))
        log.info("worker registered", extra={"worker_id": request.worker_id,
                                             "incarnation": settings.incarnation})
        return convert.worker_settings(settings)

    @_unary
    def SelectBatch(self, request, context):
        started = time.perf_counter()
        decision = convert.decision(self.call(self._core.select_batch,
                                              convert.worker_report(request)))
        if self._metrics is not None:
            self._metrics.select_batch_duration.observe(time.perf_counter() - started)
        return decision

    @_unary
    def DeregisterWorker(self, request, context):
        requeued = self.call(self._core.deregister_worker, convert.worker_id(request),
                             request.incarnation)
        log.info("worker deregistered", extra={"worker_id": request.worker_id,
                                               "requeued": requeued})
        return pb.DeregisterWorkerResponse(requeued=requeued)

    @_unary
    def DrainWorker(self, request, context):
        num_assigned = self.call(self._core.drain_worker, convert.worker_id(request),
                                 request.resume)
        log.info("worker drain lifted" if request.resume else "worker drained",
                 extra={"worker_id": request.worker_id, "num_assigned": num_assigned})
        return pb.DrainWorkerResponse(num_assigned=num_assigned)

    @_unary
    def GetStatus(self, request, context):
        with self._changed:
            return convert.status(self._core.status())

    def Generate(self, request, context):
        """Submit, then stream tokens until the sequence finishes or the client leaves."""
        try:
            seq_id = self.call(self._core.submit, convert.submit_params(request)).seq_id
        except SchedulerError as err:
            context.abort(status_code(err), status_details(err))
        # A client that goes away cancels its sequence (a no-op once it has finished).
        context.add_callback(lambda: self._cancel_quietly(seq_id))
        yield convert.generate_event(seq_id)
        sent = 0
        while context.is_active():
            with self._changed:
                view = self._core.read_output(seq_id, sent)
                if not view.token_ids and not view.finished:
                    self._changed.wait(_STREAM_POLL_SECONDS)
                    view = self._core.read_output(seq_id, sent)
            if view.token_ids or view.finished:
                sent += len(view.token_ids)
                yield convert.generate_event(seq_id, view.token_ids, view.finish_reason,
                                             view.finished, view.error_message)
            if view.finished:
                return

    def _cancel_quietly(self, seq_id: int) -> None:
        with self._changed:
            if self._stopping:
                return
        try:
            self.call(self._core.cancel, seq_id)
        except NotFound:
            pass
        except SchedulerError:  # e.g. the store failed: the sequence runs on, logged
            log.exception("could not cancel seq_id %d after its client left", seq_id)

    def expire_leases(self) -> list[str]:
        dropped = self.call(self._core.expire_leases)
        for worker_id in dropped:
            log.warning("worker lease expired; its sequences went back to the queue",
                        extra={"worker_id": worker_id})
        return dropped
