"""Group commit on PostgreSQL: the saves of concurrent calls on one replica go to the
database in one transaction, and each call answers after the commit that holds its save.

The core saves on the event loop (PostgresState.save, after `defer_saves`, only adds the
change to the batch collecting: no round trip on the loop). A call that must not answer
before its change is committed awaits `committed()`: if no commit is running, one starts
on the commit thread and takes every save collected until then; if one is running, the
caller waits for it and then for the next, which starts as soon as it ends and takes every
save made meanwhile. So while one commit is in flight, every worker's SelectBatch (and
Cancel, RegisterWorker, ...) on the replica saves and waits, and the next single commit
answers all of them.

Before it starts, a commit waits up to `max_wait_seconds` for more saves to join, and no
longer than it takes `expected_saves()` saves to be collected (the replica passes its
number of workers: each has at most one SelectBatch in flight, so once every worker has
saved, nobody is left to wait for). A commit that starts at once gathers only the saves
made while the one before it ran, and the cheaper a commit, the fewer: at 16 workers on
one replica 0.2-0.3 commits a decision without a wait, about 0.1 with one (docs/replicas.md).

A caller whose answer is due later (a worker that overlaps its report with its step says
when that step should end: `due_seconds`) lets the commit wait longer: up to
`max_due_wait_seconds` from the gather's start, and not past its due less a margin (a
recent commit's time and MARGIN_SECONDS). The wait ends at the earliest end that any of
its callers allows; a caller with no due (or a due before it) allows what every caller
did before, `max_wait_seconds` from the gather's start, so no caller waits longer than
before unless every caller in the commit can afford it. A reader (a stream waiting for a
worker's tokens to be committed) saved nothing and leaves the wait to those who did.

What this keeps (docs/replicas.md, "What is guaranteed"):
- Nothing is acknowledged before its commit: every call that changed the core's state
  awaits `committed()` before it answers, streams included (ReplicaServicer).
- A failed commit applies nothing, or (its reply lost after COMMIT) everything: it is
  retried first, alone, under its commit number, and applies nothing twice (StoreError
  to the calls that waited: UNAVAILABLE).
- One owner per sequence: a commit checks the replica's fence (or each row), and leaves
  out the changes of sequences another replica took over; `on_disowned` gives those up
  in the core on the loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from service.core.persist.store import StoreError
from service.state.postgres import PostgresState

log = logging.getLogger(__name__)

# How often pending saves nobody waits for (the sweeper's, the keeper's) are committed.
IDLE_COMMIT_SECONDS = 0.05
# Kept between a commit's start and a due answer beyond a recent commit's time: the
# answer's trip back and the worker's scheduling.
MARGIN_SECONDS = 0.002
# Weight of the newest commit in the moving average of commits' times.
SMOOTHING = 0.2


class ReplicaCommits:
    """Shares commits of a PostgresState among the calls waiting for them."""

    def __init__(
        self,
        store: PostgresState,
        on_disowned: Callable[[frozenset[int]], None],
        max_wait_seconds: float = 0.0,
        expected_saves: Callable[[], float] = lambda: math.inf,
        on_commit: Callable[[int, str], None] | None = None,
        max_due_wait_seconds: float = 0.0,
    ) -> None:
        """`on_disowned(seq_ids)`, on the loop: a commit left these out, another replica
        owns them now. A commit waits up to `max_wait_seconds` for more saves, and not
        once `expected_saves()` are collected. The store counts commits and the saves
        they held; `on_commit(num_saves, gathered)` after each commit that succeeded
        (figures): how many saves it took and how its wait ended ("enough", "expired",
        "promptly", "none"). A caller whose answer is due later lets a commit wait up to
        `max_due_wait_seconds` (the module docstring)."""
        self._store = store
        self._on_disowned = on_disowned
        self._max_wait_seconds = max_wait_seconds
        self._max_due_wait_seconds = max_due_wait_seconds
        self._commit_seconds = 0.0  # moving average of a commit's time
        # The earliest due (less the margin, loop time) among the callers waiting for the
        # next commit before its gather starts: -inf once one has none, inf while none came.
        self._next_due_end = math.inf
        self._gather_start = 0.0  # the running gather's start (loop time)
        self._gather_end = math.inf  # and its end
        self._expected_saves = expected_saves
        # Set while a commit waits for saves: wakes it once enough are collected.
        self._gathered: asyncio.Event | None = None
        self._expected = 0.0  # expected_saves(), read once as a commit starts gathering
        # A caller asked for its save to be committed without waiting for more (until the
        # next commit takes the saves collected).
        self._promptly = False
        self._on_commit = on_commit or (lambda num_saves, gathered: None)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="replica-commit")
        self._num_committed = 0  # saves known committed
        self._flush: asyncio.Future | None = None  # the commit running now
        store.defer_saves()

    @property
    def takes_dues(self) -> bool:
        """Whether a caller's due may lengthen a commit's wait."""
        return self._max_due_wait_seconds > self._max_wait_seconds

    async def committed(
        self, promptly: bool = False, due_seconds: float = 0.0, reader: bool = False
    ) -> None:
        """Return once every save made so far is committed; StoreError if the commit that
        was to hold them failed (they stay collected for the next one). `promptly`: the
        commit that takes them waits for no more saves (a caller holding what others
        wait for, such as the claim lock, would hold them for the whole wait).
        `due_seconds`: the caller needs no answer sooner (0: as soon as before).
        `reader`: the caller saved nothing and waits for others' saves (a stream): it
        leaves the wait to them."""
        wanted = self._store.num_saves
        if promptly:
            self._promptly = True
        if self._num_committed < wanted and not (promptly or reader):
            self._allow(due_seconds)
        if self._gathered is not None and (promptly or self._enough_collected()):
            self._gathered.set()
        while self._num_committed < wanted:
            if self._flush is None:
                self._flush = asyncio.ensure_future(self._commit())
            # Shielded: a caller that goes away does not stop the commit others wait for.
            await asyncio.shield(self._flush)

    def _allow(self, due_seconds: float) -> None:
        """Take in the end of the wait a new caller allows (the module docstring)."""
        now = asyncio.get_running_loop().time()
        due_end = -math.inf  # when its answer is due, less the margin (no due: at once)
        if due_seconds > 0 and self._max_due_wait_seconds > 0:
            due_end = now + due_seconds - self._commit_seconds - MARGIN_SECONDS
        if self._gathered is None:  # before the gather: its start is not known yet
            self._next_due_end = min(self._next_due_end, due_end)
            return
        end = self._end(self._gather_start, due_end)
        if end < self._gather_end:  # sooner than the gather's end: wake it to wait less
            self._gather_end = end
            self._gathered.set()

    def _end(self, start: float, due_end: float) -> float:
        """The end a caller allows, counted from the gather's `start`, with its due less
        the margin: the plain wait's end unless the due is later (inf: no caller has one)."""
        plain, longest = start + self._max_wait_seconds, start + self._max_due_wait_seconds
        if not plain < due_end < math.inf:
            return plain
        return max(plain, min(due_end, longest))

    def _cut_by_due(self) -> bool:
        """Whether a caller's due, not a wait's limit, set the running gather's end."""
        plain = self._gather_start + self._max_wait_seconds
        return plain < self._gather_end < self._gather_start + self._max_due_wait_seconds

    async def _commit(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            gathered = "none"
            start = loop.time()
            end = self._end(start, self._next_due_end)
            self._next_due_end = math.inf
            if end > start and not self._promptly:
                # Once a commit, not at every save: each call checks while it gathers.
                self._expected = self._expected_saves()
                if not self._enough_collected():
                    gathered = await self._gather(start, end)
            # Saves from here on go to the next commit, which waits unless asked again.
            self._promptly = False
            covered = self._store.num_saves  # collected before the commit takes them
            started = time.perf_counter()
            disowned = await loop.run_in_executor(self._executor, self._store.commit_pending)
            took = time.perf_counter() - started
            self._commit_seconds += SMOOTHING * (took - self._commit_seconds)
            self._on_commit(covered - self._num_committed, gathered)
            self._num_committed = max(self._num_committed, covered)
            if disowned:
                log.warning(
                    "a commit left out sequences another replica owns now; given up here",
                    extra={"sequences": len(disowned)},
                )
                self._on_disowned(disowned)
        finally:
            self._flush = None

    def _enough_collected(self) -> bool:
        return self._store.num_saves - self._num_committed >= self._expected

    async def _gather(self, start: float, end: float) -> str:
        """Let more saves join: until `expected_saves()` are collected (each saving call
        checks, in `committed`: "enough"), at most until `end` (loop time: "expired", or
        "due" where a caller's due set it), which a caller that arrives meanwhile may
        bring forward."""
        loop = asyncio.get_running_loop()
        self._gathered = asyncio.Event()
        self._gather_start, self._gather_end = start, end
        try:
            while not (self._promptly or self._enough_collected()):
                remaining = self._gather_end - loop.time()
                if remaining <= 0:
                    break
                try:
                    await asyncio.wait_for(self._gathered.wait(), remaining)
                except TimeoutError:
                    break
                self._gathered.clear()
            else:
                return "promptly" if self._promptly else "enough"
            return "due" if self._cut_by_due() else "expired"
        finally:
            self._gathered = None
            self._gather_end = math.inf

    async def run(self) -> None:
        """Until cancelled: commit saves that nobody waits for (a sweep's, an upkeep's)."""
        while True:
            await asyncio.sleep(IDLE_COMMIT_SECONDS)
            if self._flush is None and self._num_committed < self._store.num_saves:
                try:
                    await self.committed()
                except StoreError as err:
                    log.warning("could not commit; retrying: %s", err)
                    await asyncio.sleep(0.5)

    async def close(self) -> None:
        """A last commit of what is collected, then the thread ends."""
        try:
            await self.committed()
        except StoreError as err:
            log.error("last commit at shutdown failed: %s", err)
        finally:
            self._executor.shutdown(wait=True)
