"""How late the event loop gets to what is ready: the stall a call's own clock cannot see.

Every RPC handler runs on one event loop. A call that arrives while the loop is busy
(a long core call, a burst of client calls, a process frozen or starved of CPU) waits
before its handler starts, and grpc does not say when it arrived: timing a handler from
its first line misses exactly the stalls an operator needs to see. `LoopLag` ticks every
`tick_seconds` and measures how late each tick runs. `delay()` is what a handler that
starts now adds to its own duration: how long the loop has been overdue (the next tick is
late), or the last tick's lateness when that tick ran less than one tick ago (the stall
ended just before this handler started). A call that arrived just after a stall may be
charged with it: the figure errs on the side of showing stalls.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

# asyncio wakes timers up to a millisecond late by design (epoll's timeout is in whole
# milliseconds); lateness below this is the loop's resolution, not a stall.
RESOLUTION_SECONDS = 0.002


class LoopLag:
    """The event loop's lateness; run() on the loop, read delay() from handlers."""

    def __init__(
        self,
        tick_seconds: float = 0.025,
        observe: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """`observe(lag_seconds)` is called with each tick's lateness (a histogram)."""
        self._tick_seconds = tick_seconds
        self._observe = observe
        self._clock = clock
        self._next_tick_at = clock() + tick_seconds
        self._last_tick_at = float("-inf")
        self._last_lag = 0.0

    async def run(self) -> None:
        """Tick until cancelled."""
        while True:
            self._next_tick_at = self._clock() + self._tick_seconds
            await asyncio.sleep(self._tick_seconds)
            now = self._clock()
            lag = max(0.0, now - self._next_tick_at)
            self._last_tick_at, self._last_lag = now, lag
            if self._observe is not None:
                self._observe(lag)

    def delay(self) -> float:
        """Seconds a call whose handler starts now may have waited for the loop (0 if none)."""
        now = self._clock()
        overdue = now - self._next_tick_at
        recent = self._last_lag if now - self._last_tick_at < self._tick_seconds else 0.0
        delay = max(overdue, recent)
        return delay if delay > RESOLUTION_SECONDS else 0.0
