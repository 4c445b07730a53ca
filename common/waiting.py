"""Bounded waits for tests and scripts: poll until something holds, or fail saying what."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class WaitFailed(AssertionError):
    """A wait ran out of time or gave up (an AssertionError: in a test, a failure)."""


def wait_until(
    probe: Callable[[], T],
    what: str,
    timeout_seconds: float,
    *,
    done: Callable[[T], object] = bool,
    every_seconds: float = 0.05,
    retry_on: tuple[type[BaseException], ...] = (),
    gone: Callable[[], str | None] | None = None,
) -> T:
    """Call `probe()` until `done(value)` is true (by default: until the value is truthy)
    and return that value; it is called at least once, however short the timeout.

    `retry_on`: exceptions of these types count as "not yet" (the last one is shown if the
    wait times out). `gone()`: a reason to stop waiting at once (say, the process that
    should answer has exited), or None; its reason fails the wait.

    On timeout raises WaitFailed naming `what`, the last value seen and the last error.
    """
    deadline = time.monotonic() + timeout_seconds
    value: object = None
    last_error: BaseException | None = None
    while True:
        try:
            value = probe()
            if done(value):
                return value
        except retry_on as err:
            last_error = err
        if gone is not None and (reason := gone()) is not None:
            raise WaitFailed(f"gave up waiting for {what}: {reason}")
        if time.monotonic() >= deadline:
            raise WaitFailed(
                f"timed out after {timeout_seconds:g} s waiting for {what}; last saw {value!r}"
                + (f" (last error {_describe(last_error)})" if last_error is not None else "")
            )
        time.sleep(every_seconds)


def _describe(err: BaseException) -> str:
    # A grpc.RpcError says most through code() and details(); common imports no grpc.
    code, details = getattr(err, "code", None), getattr(err, "details", None)
    if callable(code) and callable(details):
        try:
            return f"{code().name}: {details()}"
        except Exception:  # noqa: BLE001 - fall back to its text
            pass
    return f"{type(err).__name__}: {err}"
