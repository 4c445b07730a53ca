"""common/signals.py: a signal is acted on by the signal thread, never inside a handler on
the main thread, so acting on it may take locks the main thread holds (the deadlock
`lattice-worker` once hit: Event.set in a handler, Event.wait on the main thread)."""

from __future__ import annotations

import os
import signal
import threading
import time

from common.signals import SignalThread
from common.waiting import wait_until


def test_a_signal_is_handled_on_the_signal_thread_and_close_restores_the_handler():
    seen: list[tuple[signal.Signals, str]] = []
    before = signal.getsignal(signal.SIGUSR1)
    with SignalThread(
        (signal.SIGUSR1,), lambda s: seen.append((s, threading.current_thread().name))
    ):
        os.kill(os.getpid(), signal.SIGUSR1)
        wait_until(lambda: seen, "the signal handled", 5)
    assert seen == [(signal.SIGUSR1, "signals")]
    assert signal.getsignal(signal.SIGUSR1) is before


def test_signals_landing_while_the_main_thread_waits_on_the_event_they_set_never_hang_it():
    """The main thread polls `stop` as fast as it can while 2,000 signals arrive; each
    sets `stop`, which the main thread clears. With `stop.set()` inside a handler this
    hangs (still waiting after 60 s) or overflows the stack (the handler re-enters the
    condition the interrupted `wait()` holds); with the signal thread every wait returns."""
    stop = threading.Event()
    sent_all = threading.Event()
    handled = []

    def on_signal(signum):
        stop.set()
        handled.append(signum)

    def send() -> None:
        for _ in range(2000):
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.0001)
        sent_all.set()

    with SignalThread((signal.SIGUSR1,), on_signal):
        sender = threading.Thread(target=send)
        sender.start()
        deadline = time.monotonic() + 60
        while not sent_all.is_set():
            assert time.monotonic() < deadline, "the main thread's waits did not keep returning"
            stop.wait(0)
            stop.clear()
        sender.join()
    assert handled  # signals coalesce: some of the 2,000, not all
