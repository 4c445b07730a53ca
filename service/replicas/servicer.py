"""One scheduler replica among several sharing a PostgreSQL database (docs/replicas.md).

`ReplicaServicer` serves the same RPCs as `SchedulerServicer` over a core that holds
only what this replica owns:
- Submit writes to the shared queue (service/state/postgres.py); Cancel, GetSequence and
  Generate work for any sequence of the caller's principal (admin: any): from the core
  when this replica owns it, else from the database (Cancel: the owner is told and
  applies it); a Generate stream of another replica's sequence is relayed from that
  replica where it can be (FollowSequence, service/replicas/peers.py), which streams what
  it committed of the sequences it owns.
- RegisterWorker adopts what the worker held on another replica (it moved here).
- SelectBatch decides from the local queue; only when that cannot fill the workers'
  free places while the shared queue may hold work does it claim in line.

The core is called on the event loop only, as in SchedulerServicer. Its saves are
collected there and committed in groups on the commit thread (service/state/pg_commit.py):
each call that changed state answers after the commit that holds its save, and one commit
serves every call that saved while the previous one was in flight. Every other database
call runs in a thread (`asyncio.to_thread`), so the loop serves other calls meanwhile. Two
tasks keep the replica going: the prefetcher claims queued sequences ahead of the
workers' needs (`prefetch` beyond their free places), and the keeper renews the lease,
returns dead replicas' sequences to the shared queue, gives up what others took over and
hands back claims its workers cannot use. A listener thread turns notifications into
wake-ups on the loop (requeues, cancels, hand-backs and take-overs). Commits, submits and
claims notify no one (PostgreSQL wakes every listener at each NOTIFY): a watcher thread
reads the other replicas' commit numbers and the newest seq_id every --replica-watch-ms,
and which unclaimed sequences that streams here wait on have an owner now, and wakes the
prefetcher for new submits and the streams of sequences claimed or whose owner committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import grpc

from lattice.scheduler.v1 import scheduler_pb2 as pb
from service.core import SEES_ALL, Caller, NotFound, ReplicaScheduler, SchedulerError, SequenceState
from service.core.types import SubmitParams, SubmitResult
from service.replicas.peers import REFUSED_SECONDS, Peers
from service.server import convert
from service.server.interceptors.auth import Callers
from service.server.loop_lag import LoopLag
from service.server.metrics import SchedulerMetrics
from service.server.servicer import SchedulerServicer, rpc
from service.server.status_codes import status_code, status_details
from service.server.wakeups import Wakeups, wait_event
from service.state.pg_commit import ReplicaCommits
from service.state.postgres import (
    CANCEL_CHANNEL,
    DISOWN_CHANNEL,
    PROGRESS_CHANNEL,
    SUBMIT_CHANNEL,
    Claimed,
    PostgresState,
    Watched,
    parse_ids_payload,
)

log = logging.getLogger(__name__)

# A stream of a sequence another replica owns re-reads the database at least this often
# (notifications wake it sooner; this bounds the wait if one is lost, or when the
# sequence moves to this replica).
_REMOTE_POLL_SECONDS = 1.0
# ... and this often while it is unclaimed: the watcher's reading finds its claim (each
# such sequence looked up in every ceil(n / WATCHED_UNCLAIMED) readings), a claim here
# wakes it, and so do a cancel's and a requeue's notifications. Each read costs
# PostgreSQL two statements: at 1 s, 300 queued streams were most of its CPU (stop 52).
_UNCLAIMED_POLL_SECONDS = 5.0
# The watcher looks up at most this many of the unclaimed sequences that streams here wait
# on a reading, in turns (`_unclaimed_window`): with more waiting, each is looked up at
# least once in every ceil(n / 64) readings, so sequences that nobody claims for long (an
# adapter no worker has) do not keep the others to the poll above.
WATCHED_UNCLAIMED = 64
# The prefetcher claims at least this often, whatever the hints say.
_PREFETCH_ANYWAY_SECONDS = 0.5
# A seq_id below the newest one the watcher saw, not seen visible yet, is looked for this
# long (its submit may commit late; one refused by a conflict never will).
_GAP_SECONDS = 1.0
_MAX_GAPS = 10_000  # more ids than this between two readings: no gaps are tracked


class _Hint:
    """ "The shared queue may hold unclaimed work": set by submits and returns, cleared
    by a claim that came back short, unless it was set again while that claim ran (a
    submit committed after the claim's snapshot). Used on the loop only."""

    def __init__(self) -> None:
        self._generation = 0
        self._set = True

    def set(self) -> None:
        self._generation += 1
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def generation(self) -> int:
        return self._generation

    def clear_unless_set_since(self, generation: int) -> None:
        if self._generation == generation:
            self._set = False


class _Submits:
    """What the watcher knows of the shared queue's submits (no submit notifies): the
    newest seq_id it saw visible, and the ids below it it has not seen visible yet (handed
    out to submits that may not have committed when it looked). A submit is seen when
    the newest id moves past the last, or one of those shows up. Used on the watcher's
    thread only."""

    def __init__(self) -> None:
        self.after: int | None = None  # None: not read yet
        self.pending: dict[int, float] = {}  # seq_id -> until when it is looked for

    def postpone(self, seconds: float) -> None:
        """Readings were skipped for `seconds`: the ids looked for are looked for that
        much longer (a skipped reading looked for none of them)."""
        for seq_id in self.pending:
            self.pending[seq_id] += seconds

    def update(self, watched: Watched, now: float) -> bool:
        """Take one reading in; whether a submit may have landed since the last one (on
        the first reading: yes, anything may have)."""
        arrived = self.after is None or bool(watched.filled)
        for seq_id in watched.filled:
            self.pending.pop(seq_id, None)
        if self.after is not None and watched.newest > self.after:
            arrived = True
            if watched.newest - self.after <= _MAX_GAPS:  # looked for from the next reading
                for seq_id in range(self.after + 1, watched.newest):
                    self.pending[seq_id] = now + _GAP_SECONDS
        # Not lowered when the newest rows are deleted (forgotten): ids only grow.
        self.after = max(self.after or 0, watched.newest)
        for seq_id in [s for s, until in self.pending.items() if until < now]:
            del self.pending[seq_id]
        return arrived


class ReplicaServicer(SchedulerServicer):
    """The Scheduler service of one replica; see the module docstring."""

    def __init__(
        self,
        core: ReplicaScheduler,
        wakeups: Wakeups,
        state: PostgresState,
        *,
        metrics: SchedulerMetrics | None = None,
        lag: LoopLag | None = None,
        prefetch: int = 8,
        callers: Callers | None = None,
        commit_wait_seconds: float = 0.0,
        commit_due_wait_seconds: float = 0.0,
        watch_seconds: float = 0.02,
        peers: Peers | None = None,
        advertise: Callable[[int], str] | None = None,
    ) -> None:
        # A commit waits for more saves until each busy worker of this replica has saved
        # (at most one SelectBatch each in flight; an idle worker's long poll saves
        # nothing), at most commit_wait_seconds; up to commit_due_wait_seconds while every
        # caller's answer is due later than that (answer_due_us).
        self._commits = ReplicaCommits(
            state,
            self._on_disowned,
            commit_wait_seconds,
            expected_saves=lambda: max(1, self._core.num_busy_workers()),
            on_commit=None if metrics is None else metrics.on_replica_commit,
            max_due_wait_seconds=commit_due_wait_seconds,
        )
        # Every call that changed state waits for its commit (durable_worker_progress):
        # on a replica the commit itself is deferred, not only its WAL flush.
        super().__init__(
            core,
            wakeups,
            metrics=metrics,
            lag=lag,
            callers=callers,
            durable=self._commits.committed,
            durable_worker_progress=True,
        )
        self._state = state
        self._prefetch = prefetch
        self._queue_hint = _Hint()
        self._wake_prefetcher = asyncio.Event()
        # One claim at a time, and nothing that compares the core's sequences with the
        # database's while one is in flight.
        self._claim_lock = asyncio.Lock()
        # Streams of sequences another replica owns, woken by notifications.
        self._remote: dict[int, set[asyncio.Event]] = {}
        # Which replica owned each of them at its stream's last read (None: unclaimed).
        self._remote_owner: dict[int, int | None] = {}
        # A thread reads the other replicas' commit numbers and the new submits this often
        # (--replica-watch-ms): neither commits nor submits notify.
        self._watch_seconds = watch_seconds
        self._listener_stop = threading.Event()
        self._listener: threading.Thread | None = None
        self._watcher: threading.Thread | None = None
        # Tasks started from callbacks (cancels, notifications): the loop keeps only weak
        # references to tasks, so these are held here until they are done.
        self._side_tasks: set[asyncio.Task] = set()
        # Streams of other replicas' sequences are relayed from their owners through these
        # (None: they read the database); advertise(port) is where the others reach this
        # one, given the port it listens on.
        self._peers = peers
        self._advertise = advertise
        # When the keeper last renewed the lease (the lease was taken at the store's start).
        self._renewed_at = time.monotonic()

    @property
    def replica_id(self) -> int:
        return self._state.replica_id

    # ------------------------------------------------------------------ lifecycle

    def background_tasks(self, port: int) -> list[asyncio.Task]:
        """Start the prefetcher, the keeper and the listener thread; say where the other
        replicas reach this one, listening on `port`."""
        if self._advertise is not None:
            self._start_side_task(self._publish_address(self._advertise(port)))
        self._listener = threading.Thread(
            target=self._listen, args=(self._loop,), name="replica-listener", daemon=True
        )
        self._listener.start()
        self._watcher = threading.Thread(
            target=self._watch, args=(self._loop,), name="replica-watcher", daemon=True
        )
        self._watcher.start()
        return [
            asyncio.create_task(self._prefetch_loop(), name="replica-prefetcher"),
            asyncio.create_task(self._keep_loop(), name="replica-keeper"),
            asyncio.create_task(self._commits.run(), name="replica-commits"),
        ]

    async def _publish_address(self, address: str) -> None:
        try:
            await asyncio.to_thread(self._state.publish_address, address)
        except SchedulerError as err:  # its streams are read from the database meanwhile
            log.warning("cannot publish this replica's address %s: %s", address, err)
        else:
            log.debug("other replicas reach this one at %s", address)

    async def leave(self) -> None:
        """A clean stop: unadmitted claims back to the shared queue, the lease ended."""
        self._listener_stop.set()
        if self._peers is not None:
            await self._peers.close()
        await self._commits.close()
        try:
            await asyncio.to_thread(self._state.leave)
        except SchedulerError as err:
            log.warning(
                "could not hand back this replica's claims; they return when its "
                "lease runs out: %s",
                err,
            )
        for thread in (self._listener, self._watcher):
            if thread is not None:
                await asyncio.to_thread(thread.join, 5.0)

    # ------------------------------------------------------------------ clients

    @rpc
    async def Submit(self, request, context):
        return convert.submit_response(await self._submit(self._submit_params(request, context)))

    @rpc
    async def Cancel(self, request, context):
        caller = self._callers.caller(context)
        return pb.CancelResponse(cancelled=await self._cancel(request.seq_id, caller))

    @rpc
    async def GetSequence(self, request, context):
        seq_id, caller = request.seq_id, self._callers.caller(context)
        if self._owns(seq_id):
            info = self._core.get_sequence(seq_id, caller)
            if info.state is not SequenceState.QUEUED:
                await self._commits.committed()  # nothing told before its commit
                if self._owns(seq_id):  # still ours: the commit took what `info` holds
                    return convert.sequence_info(info)
        # Queued (its position is the shared queue's) or another replica's.
        return convert.sequence_info(
            await asyncio.to_thread(self._state.sequence_info, seq_id, caller)
        )

    @rpc
    async def GetStatus(self, request, context):
        status = self._core.status()
        depth = await asyncio.to_thread(self._state.queue_depth)
        return convert.status(replace(status, queue_depth=depth))

    @rpc
    async def RegisterWorker(self, request, context):
        registration = convert.worker_registration(request)
        incarnation = await asyncio.to_thread(self._state.next_incarnation)
        async with self._claim_lock:
            self._core.hand_out_incarnations_from(incarnation)
            settings = self._core.register_worker(registration)
            self._running_lists.forget(registration.worker_id)
            moved = await asyncio.to_thread(self._state.adopt_worker, registration.worker_id)
            self._adopt(moved, registration.worker_id)
        await self._commits.committed()
        # Its adapters may serve sequences no claim here could take before.
        self._queue_hint.set()
        self._wake_prefetcher.set()
        log.info(
            "worker registered",
            extra={
                "worker_id": request.worker_id,
                "incarnation": settings.incarnation,
                "adopted": len(moved.sequences),
            },
        )
        response = convert.worker_settings(settings)
        response.accepts_answer_due = self._commits.takes_dues
        return response

    async def _select(self, request: pb.SelectBatchRequest) -> pb.SchedulerDecision:
        freeing = len(request.finished)
        # A report that is not draining takes work, even if this worker's last one drained.
        resuming = "" if request.draining else request.worker_id
        if self._short(freeing, resuming):  # the prefetcher fell behind: claim in line
            await self._top_up(only_if_short=True, num_freeing=freeing, resuming=resuming)
        answer = await super()._select(request)
        if self._core.prefetch_wanted(self._prefetch):
            self._wake_prefetcher.set()
        return answer

    async def _answer_durable(self, request: pb.SelectBatchRequest, started: float) -> None:
        due_seconds = 0.0
        if request.answer_due_us:  # due from its arrival: less the time spent on it since
            due_seconds = request.answer_due_us * 1e-6 - (time.perf_counter() - started)
        await self._commits.committed(due_seconds=max(0.0, due_seconds))

    async def Generate(self, request, context):
        """Submit to the shared queue, then stream tokens from whoever owns the sequence:
        relayed from the owner replica (FollowSequence) where it can be, else read from
        the database after each of the owner's commits."""
        try:
            seq_id = (await self._submit(self._submit_params(request, context))).seq_id
        except SchedulerError as err:
            await context.abort(status_code(err), status_details(err))
        context.add_done_callback(
            lambda _context: self._loop.call_soon_threadsafe(self._cancel_quietly, seq_id)
        )
        yield convert.generate_event(seq_id)
        sent = 0
        refused: tuple[int | None, float] = (None, 0.0)  # (owner, when) it last said "not mine"
        while True:
            try:
                view, owner = await self._read(seq_id, sent, refused)
            except NotFound as err:
                await context.abort(status_code(err), status_details(err))
            except SchedulerError:
                await asyncio.sleep(_REMOTE_POLL_SECONDS)  # the database is away: retry
                continue
            if view.token_ids or view.finished:
                sent += len(view.token_ids)
                yield convert.output_event(seq_id, view)
                if view.finished:
                    return
            if owner is None:
                continue
            relayed = False
            async with contextlib.aclosing(
                self._peers.follow(owner, seq_id, sent, _forwarded(context))
            ) as events:
                async for event in events:
                    relayed = True
                    if event.token_ids or event.finished:  # not the owner's heartbeats
                        sent += len(event.token_ids)
                        yield event
                        if event.finished:
                            return
            if not relayed:  # refused at once (moved: the database lags; its stream limit;
                # a credential it does not take), or unreachable: read the database a while
                refused = (owner, time.monotonic())

    async def FollowSequence(self, request, context):
        """Stream what this replica has committed of a sequence it owns, while it owns it
        and its lease is current; FAILED_PRECONDITION once it does not own it (the caller
        reads the database instead), UNAVAILABLE once its lease may have run out."""
        seq_id, sent = request.seq_id, request.start
        if self._owns(seq_id) and not self._core.may_see(seq_id, self._callers.caller(context)):
            # As for one it does not own: a replica tells no one whose sequences it holds.
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, _not_owned(self, seq_id))
        while True:
            if time.monotonic() - self._renewed_at > self._state.lease_ttl_seconds:
                # Cut off from the database for a lease: others may own it by now.
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"replica {self.replica_id} has not renewed its lease for a lease; "
                    f"read seq_id {seq_id} from another replica",
                )
            try:
                view = await self._read_owned(seq_id, sent)
            except SchedulerError as err:  # its commit failed: the database is away
                await context.abort(status_code(err), status_details(err))
            if view is None:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, _not_owned(self, seq_id))
            # An event at least every _REMOTE_POLL_SECONDS, with tokens or without: a
            # follower that hears nothing for longer (peers.SILENT_SECONDS) presumes this
            # replica gone.
            sent += len(view.token_ids)
            yield convert.output_event(seq_id, view)
            if view.finished:
                return

    def _followable(self, owner: int | None, refused: tuple[int | None, float]) -> int | None:
        """The replica to relay a stream from, after a read of the database found the
        sequence's `owner`: that one when it is another replica this one may follow now;
        else None (read on)."""
        if self._peers is None or owner is None or owner == self.replica_id:
            return None
        if refused[0] == owner and time.monotonic() - refused[1] < REFUSED_SECONDS:
            return None
        return owner if self._peers.may_follow(owner) else None

    def _cancel_quietly(self, seq_id: int) -> None:
        if self._stopping:
            return
        task = self._start_side_task(self._cancel(seq_id))
        task.add_done_callback(_log_cancel_failure(seq_id))

    def _start_side_task(self, coro) -> asyncio.Task:
        """Run `coro` as a task held until it is done (a task nobody holds may be
        collected mid-way)."""
        task = asyncio.ensure_future(coro)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)
        return task

    # ------------------------------------------------------------------ internals

    async def _submit(self, params: SubmitParams) -> SubmitResult:
        self._core.check_submit(params)  # reads the config only
        if self._core.is_sheddable(params):
            tokens, num_replicas = await asyncio.to_thread(
                self._state.unclaimed_tokens_up_to, params.priority
            )
            self._core.shed_if_late(params, tokens, num_replicas)
        config = self._core.config
        result = await asyncio.to_thread(
            self._state.submit, params, config.max_queue, config.max_queue_per_tenant
        )
        self._queue_hint.set()
        self._wake_prefetcher.set()
        if self._metrics is not None:
            self._metrics.on_submitted(result.seq_id, params.tenant, len(params.prompt_token_ids))
        return result

    def _owns(self, seq_id: int) -> bool:
        """Whether the core holds `seq_id`."""
        return self._core.holds(seq_id)

    async def _cancel(self, seq_id: int, caller: Caller = SEES_ALL) -> bool:
        """Cancel `seq_id` for `caller` (NotFound for another principal's, wherever it is)."""
        # No claim in flight meanwhile: a sequence claimed but not yet in the core would
        # look like another replica's, and its cancel would wait for the keeper.
        async with self._claim_lock:
            if self._owns(seq_id):
                cancelled = self._core.cancel(seq_id, caller)
                # Promptly: a SelectBatch that must claim waits for this lock meanwhile.
                await self._commits.committed(promptly=True)
                if self._owns(seq_id):  # still ours: the commit took it
                    return cancelled
            return await asyncio.to_thread(self._state.cancel, seq_id, caller)

    async def _read_owned(self, seq_id: int, sent: int):
        """New committed output of `seq_id` from `sent` on, waiting for some (or for the
        end) a while, while this replica owns it; None once it does not."""
        if not self._owns(seq_id):
            return None
        # What the core holds is streamed only once committed (a replica killed before
        # its commit leaves the sequence to resume elsewhere from the database).
        with self._wakeups.watching(seq_id) as changed:
            view = self._core.read_output(seq_id, sent)
            if not (view.token_ids or view.finished):
                await wait_event(changed, _REMOTE_POLL_SECONDS)
                if not self._owns(seq_id):
                    return None
                view = self._core.read_output(seq_id, sent)
        # A reader: the wait is the savers' to set (a stream woken by a report would
        # otherwise cut the commit that report's worker allowed short).
        await self._commits.committed(reader=True)
        # Still ours: the commit took the view. One that left the sequence out (it moved)
        # committed none of it: the new owner writes those places again, so the stream
        # reads them from the database.
        return view if self._owns(seq_id) else None

    async def _read(self, seq_id: int, sent: int, refused: tuple[int | None, float] = (None, 0.0)):
        """New output of `seq_id` from `sent` on, waiting for some (or for the end) a while,
        and the replica to follow it on (None: read on): from the core while this replica
        owns it (the core holds the logprobs the database does not), else from the
        database (at once, without waiting, when its owner can be followed:
        `_followable`)."""
        while True:
            view = await self._read_owned(seq_id, sent)
            if view is not None:
                return view, None
            read = await self._read_database(seq_id, sent, refused)
            if read is not None:
                return read
            # Claimed or adopted here meanwhile: the core has it now.

    async def _read_database(self, seq_id: int, sent: int, refused: tuple[int | None, float]):
        """`_read` of a sequence this replica does not own: (the view, the replica to
        follow), or None once this replica owns it (claimed or adopted here during a read
        or a wait)."""
        # Watching before reading: a commit that lands while the read runs, and that the
        # read missed, still wakes the wait below (which then returns at once). Until the
        # read says which replica owns the sequence, any replica's commit wakes it. One
        # read a wake-up (or a poll), until one finds something to return.
        event = asyncio.Event()
        self._remote.setdefault(seq_id, set()).add(event)
        try:
            while True:
                self._remote_owner.pop(seq_id, None)
                event.clear()
                view = await asyncio.to_thread(self._state.read_output, seq_id, sent)
                if self._owns(seq_id):
                    return None
                follow = self._followable(view.owner, refused)
                if view.token_ids or view.finished or follow is not None:
                    return view, follow
                self._remote_owner[seq_id] = view.owner
                poll = _REMOTE_POLL_SECONDS if view.owner is not None else _UNCLAIMED_POLL_SECONDS
                await wait_event(event, poll)
                if self._owns(seq_id):
                    return None
        finally:
            events = self._remote.get(seq_id)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._remote[seq_id]
                    self._remote_owner.pop(seq_id, None)

    def _on_commits(self, moved: frozenset[int] | None) -> None:
        """The replicas in `moved` committed (or left) since the watcher's last reading
        of the commit numbers (None: its first reading, anything may have): wake the
        streams of their sequences, those whose read is in flight, and those the database
        says are this replica's; not those of unclaimed sequences, which the watcher
        wakes when its reading finds them claimed (on the loop)."""
        if moved is None:
            self._wake_remote(None)
            return
        for seq_id, events in self._remote.items():
            if seq_id not in self._remote_owner:  # its read is in flight: owner unknown
                wake = True
            else:
                # Unclaimed (None): the watcher wakes it once claimed; any replica's
                # commit would make every queued stream read the database for nothing.
                owner = self._remote_owner[seq_id]
                wake = owner is not None and (owner in moved or owner == self.replica_id)
            if wake:
                for event in events:
                    event.set()

    def _on_disowned(self, seq_ids: frozenset[int]) -> None:
        """A commit left these out: another replica owns them now (on the loop)."""
        self._core.disown(seq_ids & self._core.owned_seq_ids())
        self._wake_remote(set(seq_ids))

    def _wake_remote(self, seq_ids: set[int] | None) -> None:
        keys = list(self._remote) if seq_ids is None else seq_ids & self._remote.keys()
        for seq_id in keys:
            for event in self._remote[seq_id]:
                event.set()

    def _adopt(self, claimed: Claimed, worker_id: str = "") -> None:
        """Put claimed sequences in the core, then apply the cancels other replicas asked
        for while they were elsewhere."""
        if not claimed.sequences:
            return
        self._core.adopt(claimed.sequences, worker_id)
        # Streams here that wait on them as another replica's read them from the core now
        # (this replica's own commits wake no watcher).
        self._wake_remote({stored.seq_id for stored in claimed.sequences})
        for seq_id in claimed.cancel_requested:
            try:
                self._core.cancel(seq_id)
            except NotFound:
                pass
        self._wakeups.work_may_have_arrived()

    def _short(self, num_freeing: int, resuming: str = "") -> bool:
        """Whether the local queue cannot fill the workers' free places (with those a
        report is about to free, or give back: `resuming`) while the shared queue may
        hold work."""
        return self._queue_hint.is_set() and bool(
            self._core.prefetch_wanted(0, num_freeing, resuming)
        )

    async def _top_up(self, only_if_short: bool, num_freeing: int = 0, resuming: str = "") -> None:
        """Claim what the workers could use, plus `prefetch` ahead, one claim at a time: a
        SelectBatch that needs the claim in flight waits for it instead of claiming past."""
        async with self._claim_lock:
            if only_if_short and not self._core.prefetch_wanted(0, num_freeing, resuming):
                return
            wanted = self._core.prefetch_wanted(self._prefetch, num_freeing, resuming)
            if not wanted:
                return
            generation = self._queue_hint.generation()
            claimed = await asyncio.to_thread(
                self._state.claim, wanted, self._core.servable_adapters()
            )
            if len(claimed.sequences) < wanted:
                self._queue_hint.clear_unless_set_since(generation)
            self._adopt(claimed)

    async def _prefetch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            woken = await wait_event(self._wake_prefetcher, _PREFETCH_ANYWAY_SECONDS)
            self._wake_prefetcher.clear()
            # Woken: only if the shared queue may hold work. Every half second: anyway,
            # in case a hint was cleared just as a submit landed (counted from the last
            # claim, not from the last wake-up: each SelectBatch that leaves room wakes
            # this loop, so busy workers would otherwise put it off for good).
            if (
                woken
                and not self._queue_hint.is_set()
                and loop.time() - last < _PREFETCH_ANYWAY_SECONDS
            ):
                continue
            last = loop.time()
            try:
                await self._top_up(only_if_short=False)
            except SchedulerError as err:
                log.warning("prefetch failed; retrying: %s", err)
                await asyncio.sleep(0.5)
            except Exception:
                log.exception("prefetch failed; retrying")
                await asyncio.sleep(0.5)

    async def _keep_loop(self) -> None:
        every = self._state.lease_ttl_seconds / 3
        while True:
            await asyncio.sleep(every)
            counted = False
            try:
                await asyncio.to_thread(self._state.renew_lease)
                self._renewed_at = time.monotonic()
                # Whatever others took (after our lease ran out, or a worker moved) and no
                # notification told us of.
                await self._give_up(None)
                if await asyncio.to_thread(self._state.reclaim_expired):
                    self._queue_hint.set()
                    self._wake_prefetcher.set()
                await self._apply_cancels(await asyncio.to_thread(self._state.cancel_requests))
                await self._hand_back_excess()
                await self._count_queued_fleet_wide()
                counted = True
                await asyncio.to_thread(self._state.collect_token_log)
            except SchedulerError as err:
                log.warning("replica upkeep failed; retrying: %s", err)
            except Exception:
                log.exception("replica upkeep failed; retrying")
            if not counted:
                self._fleet_counts_unknown()

    async def _apply_cancels(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            try:
                self._core.cancel(seq_id)
            except NotFound:
                pass  # not adopted yet: the keeper finds the request again later
            except SchedulerError as err:
                log.warning("could not apply a cancel of seq_id %d: %s", seq_id, err)

    async def _hand_back_excess(self) -> None:
        """Queued sequences beyond what this replica's workers can use (they left, were
        drained, or took less), and those whose adapter none of them has (any more), go
        back to the shared queue for the other replicas."""
        async with self._claim_lock:
            unservable = self._core.unservable_queued()
            excess = (
                self._core.num_queued()
                - len(unservable)
                - self._core.prefetch_target(self._prefetch)
            )
            handed_back = unservable + self._core.queued_tail(max(0, excess))
            if not handed_back:
                return
            # The store holds them as they are; promptly, as the claim lock is held.
            await self._commits.committed(promptly=True)
            released = await asyncio.to_thread(
                self._state.release, list(dict.fromkeys(handed_back))
            )
            self._core.disown(released)
            if released:
                # The shared queue holds work now: a worker that takes work again before
                # this release's own notification arrives claims them back in line.
                self._queue_hint.set()
        if released:
            log.info(
                "handed queued sequences back to the shared queue",
                extra={"sequences": len(released)},
            )

    def _count_queued(self) -> None:
        """Not from the sweeper: a replica counts fleet-wide, in its keeper."""

    def _fleet_counts_unknown(self) -> None:
        """An upkeep that could not count: the fleet-wide gauges say NaN (unknown) rather
        than their last reading, which `max` over the replicas then skips."""
        if self._metrics is not None:
            self._metrics.unservable_queued.set(math.nan)
            self._metrics.fleet_queue_depth.set(math.nan)

    async def _count_queued_fleet_wide(self) -> None:
        """lattice_scheduler_unservable_queued and fleet_queue_depth, fleet-wide, from the
        database (the shared queue's kept counts: one short read)."""
        if self._metrics is not None:
            self._metrics.unservable_queued.set(
                await asyncio.to_thread(self._state.unservable_queued)
            )
            self._metrics.fleet_queue_depth.set(await asyncio.to_thread(self._state.queue_depth))

    async def _give_up(self, seq_ids: set[int] | None) -> None:
        """Forget those of `seq_ids` (None: any) that the database says another replica
        owns now; streams of them read the database from then on."""
        async with self._claim_lock:
            held = self._core.owned_seq_ids()
            if seq_ids is not None:
                held &= seq_ids
            if not held:
                return
            lost = held - await asyncio.to_thread(self._state.owned_ids)
            lost &= self._core.owned_seq_ids()  # finished here meanwhile: nothing to give up
            if lost:
                self._core.disown(lost)
                self._state.forget_prompts(lost)
        if lost:
            self._wake_remote(lost)
            log.warning(
                "sequences taken over by another replica were given up here",
                extra={"sequences": len(lost)},
            )

    # ------------------------------------------------------------------ notifications

    def _listen(self, loop: asyncio.AbstractEventLoop) -> None:
        """On its own thread: LISTEN, and hand each notification to the loop."""
        delay = 0.1
        while not self._listener_stop.is_set():
            try:
                conn = self._state.listen_connection()
            except Exception as err:  # noqa: BLE001 - the database may be away: retry
                log.warning("cannot listen for notifications; retrying: %s", err)
                self._listener_stop.wait(delay)
                delay = min(delay * 2, 2.0)
                continue
            delay = 0.1
            # Anything may have happened while we did not listen.
            loop.call_soon_threadsafe(self._on_reconnected)
            try:
                while not self._listener_stop.is_set():
                    for note in conn.notifies(timeout=0.1):
                        # Progress matters only to streams of other replicas' sequences
                        # waiting here (read without the loop: at worst one wake-up late,
                        # and such a stream re-reads every _REMOTE_POLL_SECONDS anyway).
                        if note.channel == PROGRESS_CHANNEL and not self._remote:
                            continue
                        loop.call_soon_threadsafe(self._on_notification, note.channel, note.payload)
            except Exception as err:  # noqa: BLE001
                if not self._listener_stop.is_set():
                    log.warning("notification connection lost; reconnecting: %s", err)
            finally:
                try:
                    conn.close()
                except Exception:  # noqa: BLE001 - closing a connection already lost
                    pass

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """On its own thread, with a connection of its own, every `watch_seconds`: read
        what no notification announces (`PostgresState.watch`), and hand the loop the
        submits that landed (`_on_submitted`) and, while streams of other replicas'
        sequences wait here, the replicas whose commit number moved (`_on_commits`) and
        the streams' unclaimed sequences that were claimed (`_wake_remote`). The
        first reading, and the first after the connection was lost, counts as everything
        moved. (`_remote` is read without the loop, as the listener does: at worst one
        reading late, and a stream that registers after it reads the database after.)"""
        conn = None
        marks: dict[int, int] | None = None
        submits = _Submits()
        skipped_since: float | None = None
        after = 0  # the last unclaimed id looked up: the next reading goes on past it
        delay = 0.1
        while not self._listener_stop.is_set():
            # Nobody needs a reading while no stream of another replica's sequence waits
            # here and the prefetcher already knows the shared queue may hold work (a
            # submit would tell it nothing new): skip it. Nothing is lost: the newest id
            # seen stays as it was, so the next reading sees every submit since, and the
            # ids looked for are looked for as much longer as the readings stopped.
            if marks is not None and not self._remote and self._queue_hint.is_set():
                if skipped_since is None:
                    skipped_since = time.monotonic()
                self._listener_stop.wait(self._watch_seconds)
                continue
            if skipped_since is not None:
                submits.postpone(time.monotonic() - skipped_since)
                skipped_since = None
            try:
                if conn is None:
                    conn = self._state.watch_connection()
                # Streams here of sequences unclaimed when last read: the reading says
                # which have an owner now (a claim notifies no one). A copy: the loop
                # writes the dict meanwhile.
                waiting = self._remote_owner.copy()
                unclaimed = _unclaimed_window(
                    [seq_id for seq_id, owner in waiting.items() if owner is None],
                    after,
                    WATCHED_UNCLAIMED,
                )
                after = unclaimed[-1] if len(unclaimed) == WATCHED_UNCLAIMED else 0
                watched = self._state.watch(conn, list(submits.pending), unclaimed)
            except Exception as err:  # noqa: BLE001 - the database may be away: retry
                log.warning("cannot read the replicas' commits and submits; retrying: %s", err)
                if conn is not None:
                    try:
                        conn.close()
                    except Exception:  # noqa: BLE001 - closing a connection already lost
                        pass
                conn, marks, submits = None, None, _Submits()
                self._listener_stop.wait(delay)
                delay = min(delay * 2, 2.0)
                continue
            delay = 0.1
            try:
                if submits.update(watched, time.monotonic()):
                    loop.call_soon_threadsafe(self._on_submitted)
                if watched.claimed:
                    loop.call_soon_threadsafe(self._wake_remote, set(watched.claimed))
                if watched.marks != marks:
                    if self._remote or marks is None:
                        loop.call_soon_threadsafe(self._on_commits, _moved(marks, watched.marks))
                    marks = watched.marks
            except RuntimeError:  # the loop is closed: the server stopped without leave()
                break
            self._listener_stop.wait(self._watch_seconds)
        if conn is not None:
            conn.close()

    def _on_submitted(self) -> None:
        """On the loop: the shared queue holds new work."""
        self._queue_hint.set()
        self._wake_prefetcher.set()

    def _on_reconnected(self) -> None:
        self._queue_hint.set()
        self._wake_prefetcher.set()
        self._wake_remote(None)

    def _on_notification(self, channel: str, payload: str) -> None:
        """On the loop."""
        if channel == SUBMIT_CHANNEL:  # a requeue (submits are found by the watcher)
            self._on_submitted()
        elif channel == PROGRESS_CHANNEL:
            self._wake_remote(parse_ids_payload(payload))
        elif channel in (CANCEL_CHANNEL, DISOWN_CHANNEL):
            owner, _, ids = payload.partition(":")
            if channel == DISOWN_CHANNEL:
                # Another replica took these: their streams here follow the new owner.
                self._wake_remote(parse_ids_payload(ids))
            if int(owner) != self.replica_id:
                return
            if channel == CANCEL_CHANNEL:
                self._start_side_task(self._apply_cancels([int(ids)]))
            else:
                self._start_side_task(self._give_up(parse_ids_payload(ids)))


def _not_owned(replica: ReplicaServicer, seq_id: int) -> str:
    return (
        f"replica {replica.replica_id} does not own seq_id {seq_id}; Generate with its "
        "request_id on any replica re-attaches to it"
    )


def _forwarded(context) -> list[tuple[str, str]]:
    """The client's credentials, for the owner replica to check as its own caller's."""
    return [(k, v) for k, v in context.invocation_metadata() or () if k == "authorization"]


def _unclaimed_window(ids: list[int], after: int, limit: int) -> list[int]:
    """At most `limit` of `ids`: the smallest above `after`, then, wrapping round, the
    smallest of the rest; ascending within each part."""
    if len(ids) <= limit:
        return sorted(ids)
    window = heapq.nsmallest(limit, (seq_id for seq_id in ids if seq_id > after))
    if len(window) < limit:
        window += heapq.nsmallest(limit - len(window), (s for s in ids if s <= after))
    return window


def _moved(before: dict[int, int] | None, now: dict[int, int]) -> frozenset[int] | None:
    """The replicas whose commit number moved, or that left, from `before` to `now`
    (None: there was no reading before)."""
    if before is None:
        return None
    return frozenset(r for r, n in before.items() if now.get(r) != n) | (now.keys() - before)


def _log_cancel_failure(seq_id: int):
    def done(task: asyncio.Future) -> None:
        if task.cancelled():
            return
        error = task.exception()
        if error is not None and not isinstance(error, NotFound):
            log.warning("could not cancel seq_id %d after its client left: %s", seq_id, error)

    return done
