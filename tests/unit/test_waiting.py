"""common.waiting.wait_until: the one bounded poll of tests and scripts."""

from __future__ import annotations

import pytest

from common.waiting import WaitFailed, wait_until


def test_wait_until_returns_the_first_value_that_is_done():
    values = iter([0, 0, 3, 5])
    assert wait_until(lambda: next(values), "a value", 5, every_seconds=0) == 3
    values = iter([1, 2, 7, 9])
    assert wait_until(lambda: next(values), "over 5", 5, done=lambda v: v > 5, every_seconds=0) == 7


def test_wait_until_times_out_naming_what_it_waited_for_and_the_last_value():
    with pytest.raises(WaitFailed) as err:
        wait_until(lambda: 41, "the answer", 0.05, done=lambda v: v == 42, every_seconds=0.01)
    assert "timed out after 0.05 s waiting for the answer; last saw 41" in str(err.value)
    assert isinstance(err.value, AssertionError)  # a failure in a test, not an error


def test_wait_until_retries_the_errors_it_is_told_to_and_shows_the_last_one():
    calls = []

    def flaky() -> bool:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("not yet")
        return True

    assert wait_until(flaky, "a connection", 5, retry_on=(ConnectionError,), every_seconds=0)
    with pytest.raises(WaitFailed, match=r"last error ConnectionError: refused"):
        wait_until(
            lambda: (_ for _ in ()).throw(ConnectionError("refused")),
            "x",
            0.02,
            retry_on=(ConnectionError,),
            every_seconds=0.01,
        )


def test_wait_until_lets_other_errors_through():
    with pytest.raises(KeyError):
        wait_until(lambda: {}["missing"], "a key", 5, retry_on=(ConnectionError,))


def test_wait_until_gives_up_at_once_when_gone_says_why():
    with pytest.raises(WaitFailed, match="gave up waiting for the banner: it exited with 2"):
        wait_until(lambda: None, "the banner", 60, gone=lambda: "it exited with 2")


def test_wait_until_calls_the_probe_once_even_with_no_time_left():
    assert wait_until(lambda: "ready", "ready", 0) == "ready"
