"""Signals acted on by a thread of their own rather than inside a Python signal handler.

A Python handler runs on the main thread between two of its bytecodes, whatever that
thread holds at the time. One that sets a `threading.Event` can deadlock: if the signal
lands while the main thread is inside that event's `wait()`, holding the lock of the
event's condition, the handler's `set()` waits for that lock forever (a worker
waiting for an absent scheduler hung this way, about once in a few hundred signals).
Here the handler does nothing; the interpreter writes the signal's number to a pipe
(`signal.set_wakeup_fd`, async-signal-safe) and a daemon thread reads it and calls
`on_signal(signum)`, free to take any lock and to log.
"""
from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterable


def _noted(_signum, _frame) -> None:
    """The Python-level handler: nothing to do (the wakeup fd carries the signal)."""


class SignalThread:
    """`on_signal(signum)` on a thread named "signals" for each of `signums` received,
    from `start()` (on the main thread) until `close()`; it replaces their handlers."""

    def __init__(self, signums: Iterable[signal.Signals],
                 on_signal: Callable[[signal.Signals], None]) -> None:
        self._signums = frozenset(signal.Signals(s) for s in signums)
        self._on_signal = on_signal
        self._read_fd = self._write_fd = -1
        self._previous_fd = -1
        self._previous_handlers: dict[signal.Signals, object] = {}
        self._thread: threading.Thread | None = None

    def start(self) -> SignalThread:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)  # the interpreter's write must never block
        for signum in self._signums:
            self._previous_handlers[signum] = signal.signal(signum, _noted)
        self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
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
                    self._on_signal(signal.Signals(number))

    def close(self) -> None:
        """Restore the handlers and the wakeup fd this replaced; end the thread."""
        if self._thread is None:
            return
        signal.set_wakeup_fd(self._previous_fd)
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        os.close(self._write_fd)
        self._thread.join(timeout=5)
        os.close(self._read_fd)
        self._thread = None

    def __enter__(self) -> SignalThread:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.close()
