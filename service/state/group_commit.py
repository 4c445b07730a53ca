"""Group commit: the fsync behind an acknowledgement runs off the event loop, and one
fsync acknowledges every change that was waiting for it.

The core saves each change on the loop, committed to SQLite's WAL without an fsync (the
commit is in the operating system's cache: it survives kill -9 of the scheduler, not yet
a power loss). A call that must not answer before its change survives a power loss awaits
`durable()`: if no fsync is running, one starts on the fsync thread; if one is running,
the caller waits for it and then for the next one, which starts as soon as it ends and
covers every commit made until then. So while one fsync runs, every Submit that arrives
commits and waits, and the next single fsync answers all of them.

Why this keeps every acknowledged change (service/state/sqlite.py has the details):
- SQLite's synchronous=FULL differs from NORMAL in WAL mode only by an fsync of the WAL
  file after each commit. A commit's frames are written (write(2)) before COMMIT returns,
  so an fsync of the WAL that starts after the commit covers it: the change is then as
  durable as under FULL.
- A checkpoint copies WAL frames into the database file and fsyncs both (the WAL before,
  the database after); a commit already checkpointed is durable through the database file.
  SQLite starts the WAL over only after a complete checkpoint, reusing the same file, so
  the descriptor fsync'd here is always the WAL in use.
- If an fsync fails, the changes waiting on it are not acknowledged (UNAVAILABLE), and
  neither is anything after: the page cache's state after a failed fsync is unknown, so
  the store is treated as broken until the scheduler restarts (and recovers what is on
  disk).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from service.core.persist.store import StoreError

log = logging.getLogger(__name__)

# Checkpoint (on the fsync thread) once the WAL holds this much; SQLite's own automatic
# checkpoint, off here because it would fsync on the loop, runs at about 4 MiB too.
CHECKPOINT_WAL_BYTES = 4 * 2**20
# How often the WAL's size is looked at (a change that is never acknowledged, such as a
# worker's progress under `acks`, needs no fsync, but the WAL still needs checkpoints).
CHECKPOINT_CHECK_SECONDS = 1.0


class DeferredSyncStore(Protocol):
    """What group commit needs of a store that commits without fsync (SqliteStateStore)."""

    num_commits_to_sync: int  # commits so far that must survive a power loss

    def sync_wal(self) -> None: ...  # on another thread: makes every earlier commit durable

    def wal_bytes(self) -> int: ...

    def checkpoint(self) -> None: ...  # on the fsync thread


class GroupCommit:
    """Shares fsyncs of a DeferredSyncStore among waiting callers, on one fsync thread."""

    def __init__(
        self, store: DeferredSyncStore, on_fsync: Callable[[int, float], None] | None = None
    ) -> None:
        """`on_fsync(num_commits, seconds)` after each fsync: how many commits it made
        durable, and how long it took (metrics)."""
        self._store = store
        self._on_fsync = on_fsync or (lambda num_commits, seconds: None)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="state-fsync")
        self._num_synced = 0  # commits known durable
        self._flush: asyncio.Future | None = None  # the fsync running now
        self._broken: StoreError | None = None

    async def durable(self) -> None:
        """Return once every commit made so far that must survive a power loss does;
        StoreError when it cannot (nothing may be acknowledged then)."""
        wanted = self._store.num_commits_to_sync
        while self._num_synced < wanted:
            if self._broken is not None:
                raise self._broken
            if self._flush is None:
                self._flush = asyncio.ensure_future(self._fsync())
            # Shielded: a caller that goes away (a client that left) does not stop the fsync.
            await asyncio.shield(self._flush)
        if self._broken is not None:
            raise self._broken

    async def _fsync(self) -> None:
        covered = self._store.num_commits_to_sync  # committed before the fsync starts
        started = time.perf_counter()
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._store.sync_wal)
        except StoreError as err:
            log.error(
                "state store fsync failed; nothing more is acknowledged until the "
                "scheduler restarts: %s",
                err,
            )
            self._broken = err
        else:
            self._on_fsync(covered - self._num_synced, time.perf_counter() - started)
            self._num_synced = max(self._num_synced, covered)
        finally:
            self._flush = None

    async def run_checkpoints(self) -> None:
        """Until cancelled: checkpoint on the fsync thread whenever the WAL has grown."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(CHECKPOINT_CHECK_SECONDS)
            if self._store.wal_bytes() < CHECKPOINT_WAL_BYTES:
                continue
            try:
                await loop.run_in_executor(self._executor, self._store.checkpoint)
            except StoreError:
                log.exception("state store checkpoint failed; the WAL keeps growing")

    async def close(self) -> None:
        """A last fsync (a stop loses nothing the OS still holds), then the thread ends."""
        try:
            if self._broken is None:
                await asyncio.get_running_loop().run_in_executor(
                    self._executor, self._store.sync_wal
                )
        except StoreError as err:
            log.error("state store fsync at shutdown failed: %s", err)
        finally:
            self._executor.shutdown(wait=True)
