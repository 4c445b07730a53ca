"""service/server/wakeups.py: waiting on an event with a timeout never loses a cancel.

asyncio.wait_for before Python 3.12 returns normally when its task is cancelled in the
same loop iteration as the event is set; a background loop built on it then survives the
server's stop and the stop (which cancels and awaits its tasks) hangs."""

from __future__ import annotations

import asyncio

import pytest

from service.server.wakeups import Wakeups, wait_event


async def _cancel_after(event_set_iterations: int) -> tuple[bool, str]:
    """Set the event, let the loop run `event_set_iterations` times, cancel the waiter:
    (whether the cancel was taken, how the waiter ended)."""
    event = asyncio.Event()
    task = asyncio.ensure_future(wait_event(event, 10.0))
    await asyncio.sleep(0)  # the waiter is waiting
    event.set()
    for _ in range(event_set_iterations):
        await asyncio.sleep(0)
    taken = task.cancel()
    try:
        return taken, f"returned {await task}"
    except asyncio.CancelledError:
        return taken, "cancelled"


@pytest.mark.parametrize("iterations", range(5))
def test_a_cancel_taken_while_the_event_is_being_set_ends_the_waiter(iterations):
    taken, ended = asyncio.run(_cancel_after(iterations))
    assert ended == ("cancelled" if taken else "returned True")


def test_wait_event_says_whether_the_event_was_set_in_time():
    async def run() -> tuple[bool, bool]:
        event = asyncio.Event()
        timed_out = await wait_event(event, 0.01)
        asyncio.get_running_loop().call_later(0.01, event.set)
        return timed_out, await wait_event(event, 5.0)

    assert asyncio.run(run()) == (False, True)


def test_a_parked_worker_is_woken_by_work_and_answered_at_once_after_close():
    async def run() -> tuple[bool, bool, bool]:
        wakeups = Wakeups()
        asyncio.get_running_loop().call_later(0.01, wakeups.work_may_have_arrived)
        woken = await wakeups.wait_for_work(5.0)
        idle = await wakeups.wait_for_work(0.01)
        wakeups.close()
        return woken, idle, await wakeups.wait_for_work(5.0)

    assert asyncio.run(run()) == (True, False, False)
