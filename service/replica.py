"""One scheduler replica among several sharing a PostgreSQL database (docs/replicas.md).

`ReplicaServicer` serves the same RPCs as `SchedulerServicer` over a core that holds
only what this replica owns:
- Submit writes to the shared queue (service/state_postgres.py); Cancel, GetSequence and
  Generate work for any sequence: from the core when this replica owns it, else from the
  database (Cancel: the owner is told and applies it).
- RegisterWorker adopts what the worker held on another replica (it moved here).
- SelectBatch decides from the local queue; only when that is empty while the worker
  has room and the shared queue may hold work does it claim in line.

Three threads keep the replica going: the prefetcher claims queued sequences ahead of the
workers' needs (`prefetch` beyond their free places), the listener turns notifications
into wake-ups (submits, tokens for streams, cancels for this owner), and the keeper
renews the lease, returns dead replicas' sequences to the shared queue, and gives up what
this replica no longer owns after its own lease ran out.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from dataclasses import replace

from lattice.scheduler.v1 import scheduler_pb2 as pb

from service import convert
from service.core import NotFound, Scheduler, SchedulerError, SequenceState
from service.core.store import StoreError
from service.metrics import SchedulerMetrics
from service.servicer import SchedulerServicer, _unary
from service.state_postgres import (
    CANCEL_CHANNEL, DISOWN_CHANNEL, PROGRESS_CHANNEL, SUBMIT_CHANNEL, Claimed, PostgresState,
    parse_ids_payload,
)
from service.status_codes import status_code, status_details

log = logging.getLogger(__name__)

# A stream of a sequence another replica owns re-reads the database at least this often
# (notifications wake it sooner; this bounds the wait if one is lost).
_REMOTE_POLL_SECONDS = 1.0
_LOCAL_POLL_SECONDS = 0.25


class _Waiters:
    """Events of streams waiting for sequences other replicas own, by seq_id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[int, set[threading.Event]] = defaultdict(set)

    def wait(self, seq_id: int, timeout: float) -> None:
        event = threading.Event()
        with self._lock:
            self._events[seq_id].add(event)
        try:
            event.wait(timeout)
        finally:
            with self._lock:
                events = self._events.get(seq_id)
                if events is not None:
                    events.discard(event)
                    if not events:
                        del self._events[seq_id]

    def wake(self, seq_ids: set[int] | None) -> None:
        """Wake the streams of `seq_ids` (None: every stream)."""
        with self._lock:
            keys = list(self._events) if seq_ids is None else seq_ids & self._events.keys()
            for seq_id in keys:
                for event in self._events[seq_id]:
                    event.set()


class _Hint:
    """"The shared queue may hold unclaimed work": set by submits and returns, cleared
    by a claim that came back short, unless it was set again while that claim ran (a
    submit committed after the claim's snapshot)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generation = 0
        self._set = True

    def set(self) -> None:
        with self._lock:
            self._generation += 1
            self._set = True

    def is_set(self) -> bool:
        return self._set

    def generation(self) -> int:
        return self._generation

    def clear_unless_set_since(self, generation: int) -> None:
        with self._lock:
            if self._generation == generation:
                self._set = False


class ReplicaServicer(SchedulerServicer):
    """The Scheduler service of one replica; see the module docstring."""

    def __init__(self, core: Scheduler, state: PostgresState,
                 metrics: SchedulerMetrics | None = None, *, prefetch: int = 8) -> None:
        super().__init__(core, metrics)
        self._state = state
        self._prefetch = prefetch
        self._waiters = _Waiters()
        # The shared queue may hold unclaimed work: set by submits (ours, and others'
        # notifications) and by returns of dead replicas' sequences; cleared by a claim
        # that found less than it asked for.
        self._queue_hint = _Hint()
        self._wake_prefetcher = threading.Event()
        self._claim_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def replica_id(self) -> int:
        return self._state.replica_id

    # ------------------------------------------------------------------ lifecycle

    def start_background(self) -> None:
        for name, target in (("prefetcher", self._prefetch_loop),
                             ("listener", self._listen_loop), ("keeper", self._keep_loop)):
            thread = threading.Thread(target=target, name=f"replica-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop_background(self) -> None:
        self._stop.set()
        self._wake_prefetcher.set()
        for thread in self._threads:
            thread.join(5.0)

    def leave(self) -> None:
        """A clean stop: unadmitted claims back to the shared queue, the lease ended."""
        try:
            self.call(self._state.leave)
        except StoreError as err:
            log.warning("could not hand back this replica's claims; they return when its "
                        "lease runs out: %s", err)

    # ------------------------------------------------------------------ clients

    @_unary
    def Submit(self, request, context):
        return convert.submit_response(self._submit(convert.submit_params(request)))

    @_unary
    def Cancel(self, request, context):
        return pb.CancelResponse(cancelled=self._cancel(request.seq_id))

    @_unary
    def GetSequence(self, request, context):
        seq_id = request.seq_id
        with self._changed:
            if self._owns(seq_id):
                info = self._core.get_sequence(seq_id)
                if info.state is not SequenceState.QUEUED:
                    return convert.sequence_info(info)
        # Queued (its position is the shared queue's) or another replica's.
        return convert.sequence_info(self._state.sequence_info(seq_id))

    @_unary
    def GetStatus(self, request, context):
        with self._changed:
            status = self._core.status()
        return convert.status(replace(status, queue_depth=self._state.queue_depth()))

    @_unary
    def RegisterWorker(self, request, context):
        registration = convert.worker_registration(request)

        incarnation = self._state.next_incarnation()

        def register_and_adopt():
            self._core.hand_out_incarnations_from(incarnation)
            settings = self._core.register_worker(registration)
            moved = self._state.adopt_worker(registration.worker_id)
            self._adopt(moved, registration.worker_id)
            return settings, len(moved.sequences)

        settings, num_adopted = self.call(register_and_adopt)
        log.info("worker registered", extra={"worker_id": request.worker_id,
                                             "adopted": num_adopted})
        return convert.worker_settings(settings)

    @_unary
    def SelectBatch(self, request, context):
        started = time.perf_counter()
        report = convert.worker_report(request)
        freeing = len(report.finished)
        if self._short(freeing):  # the prefetcher fell behind: claim in line
            self._top_up(only_if_short=True, num_freeing=freeing)
        with self._changed:
            decision = self._core.select_batch(report)
            self._changed.notify_all()
        if self._core.prefetch_wanted(self._prefetch):
            self._wake_prefetcher.set()
        if self._metrics is not None:
            self._metrics.select_batch_duration.observe(time.perf_counter() - started)
        return convert.decision(decision)

    def Generate(self, request, context):
        """Submit to the shared queue, then stream tokens from whoever owns the sequence."""
        try:
            seq_id = self._submit(convert.submit_params(request)).seq_id
        except SchedulerError as err:
            context.abort(status_code(err), status_details(err))
        context.add_callback(lambda: self._cancel_quietly(seq_id))
        yield convert.generate_event(seq_id)
        sent = 0
        while context.is_active():
            try:
                view = self._read(seq_id, sent)
            except StoreError:
                # The database is away: keep the stream, try again shortly.
                self._stop.wait(_REMOTE_POLL_SECONDS)
                continue
            if view.token_ids or view.finished:
                sent += len(view.token_ids)
                yield convert.generate_event(seq_id, view.token_ids, view.finish_reason,
                                             view.finished)
            if view.finished:
                return

    def _cancel_quietly(self, seq_id: int) -> None:
        with self._changed:
            if self._stopping:
                return
        try:
            self._cancel(seq_id)
        except NotFound:
            pass
        except SchedulerError:
            log.exception("could not cancel seq_id %d after its client left", seq_id)

    # ------------------------------------------------------------------ internals

    def _submit(self, params):
        self._core.check_submit(params)  # reads the config only
        config = self._core.config
        result = self._state.submit(params, config.max_queue, config.max_queue_per_tenant)
        self._queue_hint.set()
        self._wake_prefetcher.set()
        if self._metrics is not None:
            self._metrics.on_submitted(result.seq_id, params.tenant,
                                       len(params.prompt_token_ids))
        return result

    def _owns(self, seq_id: int) -> bool:
        """Whether the core holds `seq_id` (call under the lock)."""
        try:
            self._core.get_sequence(seq_id)
        except NotFound:
            return False
        return True

    def _cancel(self, seq_id: int) -> bool:
        # No claim in flight meanwhile: a sequence claimed but not yet in the core would
        # look like another replica's, and its cancel would wait for the keeper.
        with self._claim_lock:
            with self._changed:
                if self._owns(seq_id):
                    cancelled = self._core.cancel(seq_id)
                    self._changed.notify_all()
                    if self._owns(seq_id):  # still ours: the store took it
                        return cancelled
            return self._state.cancel(seq_id)

    def _read(self, seq_id: int, sent: int):
        with self._changed:
            if self._owns(seq_id):
                view = self._core.read_output(seq_id, sent)
                if view.token_ids or view.finished:
                    return view
                self._changed.wait(_LOCAL_POLL_SECONDS)
                if self._owns(seq_id):
                    return self._core.read_output(seq_id, sent)
        view = self._state.read_output(seq_id, sent)
        if view.token_ids or view.finished:
            return view
        self._waiters.wait(seq_id, _REMOTE_POLL_SECONDS)
        return self._state.read_output(seq_id, sent)

    def _adopt(self, claimed: Claimed, worker_id: str = "") -> None:
        """Put claimed sequences in the core (under the lock), then apply the cancels
        other replicas asked for while they were elsewhere."""
        if not claimed.sequences:
            return
        self._core.adopt(claimed.sequences, worker_id)
        for seq_id in claimed.cancel_requested:
            try:
                self._core.cancel(seq_id)
            except NotFound:
                pass
        self._changed.notify_all()

    def _short(self, num_freeing: int) -> bool:
        """Whether the local queue cannot fill the workers' free places (with those a
        report is about to free) while the shared queue may hold work."""
        if not self._queue_hint.is_set():
            return False
        with self._changed:
            return bool(self._core.prefetch_wanted(0, num_freeing))

    def _top_up(self, only_if_short: bool, num_freeing: int = 0) -> None:
        """Claim what the workers could use, plus `prefetch` ahead. One claim at a time
        (the claim lock is always taken before the core's lock): the database round trip
        runs outside the core's lock, and a SelectBatch that needs the claim in flight
        waits for it instead of claiming past it."""
        with self._claim_lock:
            with self._changed:
                if only_if_short and not self._core.prefetch_wanted(0, num_freeing):
                    return
                wanted = self._core.prefetch_wanted(self._prefetch, num_freeing)
            if wanted:
                claimed = self._claim(wanted)
                with self._changed:
                    self._adopt(claimed)

    def _claim(self, wanted: int) -> Claimed:
        generation = self._queue_hint.generation()
        claimed = self._state.claim(wanted)
        if len(claimed.sequences) < wanted:
            self._queue_hint.clear_unless_set_since(generation)
        return claimed

    def _prefetch_loop(self) -> None:
        while not self._stop.is_set():
            woken = self._wake_prefetcher.wait(0.5)
            self._wake_prefetcher.clear()
            # Woken: only if the shared queue may hold work. Every half second: anyway,
            # in case a hint was cleared just as a submit landed.
            if self._stop.is_set() or (woken and not self._queue_hint.is_set()):
                continue
            try:
                self._top_up(only_if_short=False)
            except SchedulerError as err:
                log.warning("prefetch failed; retrying: %s", err)
                self._stop.wait(0.5)
            except Exception:  # noqa: BLE001 - the prefetcher must keep going
                log.exception("prefetch failed; retrying")
                self._stop.wait(0.5)

    def _listen_loop(self) -> None:
        delay = 0.1
        while not self._stop.is_set():
            try:
                conn = self._state.listen_connection()
            except Exception as err:  # noqa: BLE001 - the database may be away: retry
                log.warning("cannot listen for notifications; retrying: %s", err)
                self._stop.wait(delay)
                delay = min(delay * 2, 2.0)
                continue
            delay = 0.1
            # Anything may have happened while we did not listen.
            self._queue_hint.set()
            self._wake_prefetcher.set()
            self._waiters.wake(None)
            try:
                while not self._stop.is_set():
                    for note in conn.notifies(timeout=0.5):
                        self._on_notification(note.channel, note.payload)
            except Exception as err:  # noqa: BLE001
                log.warning("notification connection lost; reconnecting: %s", err)
            finally:
                try:
                    conn.close()
                except Exception:  # noqa: BLE001
                    pass

    def _on_notification(self, channel: str, payload: str) -> None:
        if channel == SUBMIT_CHANNEL:
            self._queue_hint.set()
            self._wake_prefetcher.set()
        elif channel == PROGRESS_CHANNEL:
            self._waiters.wake(parse_ids_payload(payload))
        elif channel == CANCEL_CHANNEL:
            owner, _, seq_id = payload.partition(":")
            if int(owner) == self.replica_id:
                self._apply_cancels([int(seq_id)])
        elif channel == DISOWN_CHANNEL:
            owner, _, ids = payload.partition(":")
            if int(owner) == self.replica_id:
                self._give_up(parse_ids_payload(ids))

    def _apply_cancels(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            try:
                self.call(self._core.cancel, seq_id)
            except NotFound:
                pass  # not adopted yet: the keeper finds the request later
            except SchedulerError as err:
                log.warning("could not apply a cancel of seq_id %d: %s", seq_id, err)

    def _keep_loop(self) -> None:
        every = self._state.lease_ttl_seconds / 3
        while not self._stop.wait(every):
            try:
                self._state.renew_lease()
                self._give_up(None)  # whatever others took (after our lease ran out, or
                # a worker moved) and no notification told us of
                if self._state.reclaim_expired():
                    self._queue_hint.set()
                    self._wake_prefetcher.set()
                self._apply_cancels(self._state.cancel_requests())
                self._hand_back_excess()
            except SchedulerError as err:
                log.warning("replica upkeep failed; retrying: %s", err)
            except Exception:  # noqa: BLE001 - the keeper must keep going
                log.exception("replica upkeep failed; retrying")

    def _hand_back_excess(self) -> None:
        """Queued sequences beyond what this replica's workers can use (they left, were
        drained, or took less) go back to the shared queue for the other replicas."""
        with self._claim_lock, self._changed:
            excess = self._core.num_queued() - self._core.prefetch_target(self._prefetch)
            if excess <= 0:
                return
            released = self._state.release(self._core.queued_tail(excess))
            self._core.disown(released)
        if released:
            log.info("handed queued sequences back to the shared queue",
                     extra={"sequences": len(released)})

    def _give_up(self, seq_ids: set[int] | None) -> None:
        """Forget those of `seq_ids` (None: any) that the database says another replica
        owns now; streams of them read the database from then on."""
        with self._changed:
            held = self._core.owned_seq_ids()
            if seq_ids is not None:
                held &= seq_ids
            if not held:
                return
            lost = held - self._state.owned_ids()
            if lost:
                self._core.disown(lost)
                self._changed.notify_all()
        if lost:
            self._waiters.wake(lost)
            log.warning("sequences taken over by another replica were given up here",
                        extra={"sequences": len(lost)})
