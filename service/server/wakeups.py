"""Wake-ups on the event loop: a Generate stream when its sequence changes, a parked
worker when work may have arrived.

`Wakeups` listens to the core (a SchedulerObserver) and only sets asyncio events, so the
core stays free of asyncio; it is called on the loop, like the core.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from service.core import FinishReason, SchedulerObserver


async def wait_event(event: asyncio.Event, timeout_seconds: float) -> bool:
    """Whether `event` was set within `timeout_seconds`.

    Not asyncio.wait_for: before Python 3.12 it can lose a cancel that arrives as the event
    is set (it returns as if nothing happened), and a task looping on it then never ends,
    so a server stop that cancels its tasks and awaits them hangs. asyncio.timeout tells
    its own cancel from another (Task.uncancel), and costs a timer, not a task and a
    future as asyncio.wait did: streams wait here at every token (stop 52)."""
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(timeout_seconds):
            await event.wait()
    except TimeoutError:
        return False
    return True


class Wakeups(SchedulerObserver):
    """Per-sequence events for streams, and one shared "work may have arrived" signal."""

    def __init__(self) -> None:
        self._watchers: dict[int, list[asyncio.Event]] = {}
        self._work_arrived = asyncio.Event()
        self._closed = False

    @contextmanager
    def watching(self, seq_id: int) -> Iterator[asyncio.Event]:
        """An event set whenever `seq_id` gets tokens or finishes (clear it before reading)."""
        event = asyncio.Event()
        self._watchers.setdefault(seq_id, []).append(event)
        try:
            yield event
        finally:
            events = self._watchers[seq_id]
            events.remove(event)
            if not events:
                del self._watchers[seq_id]

    def num_watched(self) -> int:
        """Sequences with at least one stream waiting on them."""
        return len(self._watchers)

    async def wait_for_work(self, timeout_seconds: float) -> bool:
        """Until work may have arrived (True) or the time ran out or wake-ups closed (False)."""
        if self._closed:
            return False
        if not await wait_event(self._work_arrived, timeout_seconds):
            return False
        return not self._closed

    def work_may_have_arrived(self) -> None:
        """Wake every parked worker (each asks the core again)."""
        event, self._work_arrived = self._work_arrived, asyncio.Event()
        event.set()

    def close(self) -> None:
        """The server is stopping: parked workers are answered now, and none parks again."""
        self._closed = True
        self.work_may_have_arrived()

    # -- SchedulerObserver ----------------------------------------------------------

    def on_tokens(self, seq_id: int, num_tokens: int) -> None:
        self._wake(seq_id)

    def on_tokens_reported(self, worker_id: str, seq_ids: list[int], num_tokens: list[int]) -> None:
        """The watched among `seq_ids` wake (an intersection in C, then one set() per
        waiting stream)."""
        watchers = self._watchers
        if watchers:
            for seq_id in watchers.keys() & seq_ids:
                for event in watchers[seq_id]:
                    event.set()

    def on_finished(self, seq_id: int, reason: FinishReason) -> None:
        self._wake(seq_id)

    def on_disowned(self, seq_ids: frozenset[int]) -> None:
        """Their streams here learn at once that this replica no longer owns them."""
        for seq_id in seq_ids & self._watchers.keys():
            self._wake(seq_id)

    def on_handoff_started(self, seq_id: int, sender: str, receiver: str) -> None:
        self.work_may_have_arrived()  # the receiver, parked, has a RECEIVE to fetch

    def on_receive_ready(self, seq_id: int, receiver: str) -> None:
        self.work_may_have_arrived()  # the RECEIVE waited for its last token; it has it

    def on_queue_depth(self, depth: int) -> None:
        if depth > 0:
            self.work_may_have_arrived()

    def _wake(self, seq_id: int) -> None:
        for event in self._watchers.get(seq_id, ()):
            event.set()
