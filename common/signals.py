"""Signals acted on by a thread of their own rather than inside a Python signal handler.

A Python handler runs on the main thread between two of its bytecodes, whatever that
thread holds at the time. One that sets a `threading.Event` can deadlock: if the signal
lands while the main thread is inside that event's `wait()`, holding the lock of the
event's condition, the handler's `set()` waits for that lock forever, or re-enters it
until the stack overflows (2,000 signals against a loop of `Event.wait(0)`: a
RecursionError in three runs of three as a script, still hung after 60 s under pytest;
tests/unit/test_signal_thread.py). That is the likely cause of a `lattice-worker` that once
did not leave within 10 s of a SIGINT while it retried an absent scheduler. Here the handler
does nothing; the interpreter writes the signal's number to a pipe (`signal.set_wakeup_fd`, async-signal-safe) and a
daemon thread reads it and calls `on_signal(signum)`, free to take any lock and to log.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)


def _noted(_signum, _frame) -> None:
    """The Python-level handler: nothing to do (the wakeup fd carries the signal)."""


class SignalThread:
    """`on_signal(signum)` on a thread named "signals" for each of `signums` received,
    from `start()` (on the main thread) until `close()`; it replaces their handlers."""

    def __init__(
        self, signums: Iterable[signal.Signals], on_signal: Callable[[signal.Signals], None]
    ) -> None:
        self._signums = frozenset(signal.Signals(s) for s in signums)
        self._on_signal = on_signal
        self._read_fd = self._write_fd = -1
        self._previous_fd: int | None = None  # None: the wakeup fd was not replaced
        self._previous_handlers: dict[signal.Signals, object] = {}
        self._thread: threading.Thread | None = None

    def start(self) -> SignalThread:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)  # the interpreter's write must never block
        try:
            # The fd first: a signal between the two is then carried, not dropped.
            self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
            for signum in self._signums:
                self._previous_handlers[signum] = signal.signal(signum, _noted)
        except BaseException:  # not the main thread, say: leave everything as it was
            self._restore()
            os.close(self._write_fd)
            os.close(self._read_fd)
            raise
        self._thread = threading.Thread(target=self._watch, name="signals", daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while True:
            try:
                received = os.read(self._read_fd, 64)
            except OSError:  # closed under us
                return
            if not received:  # the write end closed: close() was called
                return
            for number in received:
                if number in self._signums:
                    try:
                        self._on_signal(signal.Signals(number))
                    except Exception:  # later signals must still be acted on
                        log.exception("acting on a signal failed")

    def _restore(self) -> None:
        """The handlers first, then the fd: a signal between the two is still noted."""
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()
        if self._previous_fd is not None:
            signal.set_wakeup_fd(self._previous_fd)
            self._previous_fd = None

    def close(self) -> None:
        """Restore the handlers and the wakeup fd this replaced; end the thread."""
        if self._thread is None:
            return
        self._restore()
        os.close(self._write_fd)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():  # else it may still read: leave its fd open
            os.close(self._read_fd)
        self._thread = None

    def __enter__(self) -> SignalThread:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.close()
