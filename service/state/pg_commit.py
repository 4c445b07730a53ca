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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from service.core.persist.store import StoreError
from service.state.postgres import PostgresState

log = logging.getLogger(__name__)

# How often pending saves nobody waits for (the sweeper's, the keeper's) are committed.
IDLE_COMMIT_SECONDS = 0.05


class ReplicaCommits:
    """Shares commits of a PostgresState among the calls waiting for them."""

    def __init__(
        self,
        store: PostgresState,
        on_disowned: Callable[[frozenset[int]], None],
        max_wait_seconds: float = 0.0,
        expected_saves: Callable[[], float] = lambda: math.inf,
        on_commit: Callable[[int, str], None] | None = None,
    ) -> None:
        """`on_disowned(seq_ids)`, on the loop: a commit left these out, another replica
        owns them now. A commit waits up to `max_wait_seconds` for more saves, and not
        once `expected_saves()` are collected. The store counts commits and the saves
        they held; `on_commit(num_saves, gathered)` after each commit that succeeded
        (figures): how many saves it took and how its wait ended ("enough", "expired",
        "promptly", "none")."""
        self._store = store
        self._on_disowned = on_disowned
        self._max_wait_seconds = max_wait_seconds
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

    async def committed(self, promptly: bool = False) -> None:
        """Return once every save made so far is committed; StoreError if the commit that
        was to hold them failed (they stay collected for the next one). `promptly`: the
        commit that takes them waits for no more saves (a caller holding what others
        wait for, such as the claim lock, would hold them for the whole wait)."""
        wanted = self._store.num_saves
        if promptly:
            self._promptly = True
        if self._gathered is not None and (promptly or self._enough_collected()):
            self._gathered.set()
        while self._num_committed < wanted:
            if self._flush is None:
                self._flush = asyncio.ensure_future(self._commit())
            # Shielded: a caller that goes away does not stop the commit others wait for.
            await asyncio.shield(self._flush)

    async def _commit(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            gathered = "none"
            if self._max_wait_seconds > 0 and not self._promptly:
                # Once a commit, not at every save: each call checks while it gathers.
                self._expected = self._expected_saves()
                if not self._enough_collected():
                    gathered = await self._gather()
            # Saves from here on go to the next commit, which waits unless asked again.
            self._promptly = False
            covered = self._store.num_saves  # collected before the commit takes them
            disowned = await loop.run_in_executor(self._executor, self._store.commit_pending)
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

    async def _gather(self) -> str:
        """Let more saves join: until `expected_saves()` are collected (each saving call
        checks, in `committed`: "enough"), at most `max_wait_seconds` ("expired")."""
        self._gathered = asyncio.Event()
        try:
            await asyncio.wait_for(self._gathered.wait(), self._max_wait_seconds)
        except TimeoutError:
            return "expired"
        finally:
            self._gathered = None
        return "promptly" if self._promptly else "enough"

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
