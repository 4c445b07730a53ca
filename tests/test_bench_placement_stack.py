"""bench/placement_stack.py: what counts as a resumed follow-up, when a stack is ready,
how the follow-ups' answer times compare, and its one-line refusals of bad arguments
(the stack itself runs in tests/gateway/test_placement_stack.py, slow)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.placement_stack import (
    BLOCK_TOKENS,
    Run,
    Turn,
    _reported,
    answer_ratios,
    main,
    resumed,
)
from tests.refusals import refusal_line


def _turn(conversation: int, turn: int, prompt_len: int, cached: int) -> Turn:
    return Turn(conversation, turn, "", prompt_len, cached, 10 * conversation + turn, 0.1)


def test_a_follow_up_resumed_when_its_cache_reaches_the_last_prompt_less_one_block():
    turns = [
        _turn(0, 0, 40, 0),
        _turn(0, 1, 90, 40 - BLOCK_TOKENS),  # the last prompt less one block: resumed
        _turn(0, 2, 140, 90 - BLOCK_TOKENS - 1),  # one token short: cold
        _turn(1, 0, 41, 0),
        _turn(1, 1, 91, 0),
    ]
    assert [(t.conversation, t.turn) for t in resumed(turns)] == [(0, 1)]


def test_answer_ratios_compare_the_follow_ups_only_at_each_quantile():
    def run(first_seconds: list[float], seconds: list[float]) -> Run:
        first = [Turn(20 + i, 0, "", 40, 0, 20 + i, s) for i, s in enumerate(first_seconds)]
        follow_ups = [Turn(i, 1, "", 90, 0, i, s) for i, s in enumerate(seconds)]
        return Run(first + follow_ups, {}, {}, 1.0)

    # Off's first turns are slow and many, on's are none: counted, they would move both
    # quantiles of off (to 5.0 s), and the ratios with them.
    off = run([5.0] * 12, [0.1 * i for i in range(1, 11)])  # p50 0.6 s, p90 1.0 s
    on = run([], [0.12 * i for i in range(1, 10)] + [1.5])
    p50, p90 = answer_ratios(on, off)
    assert p50 == pytest.approx(0.72 / 0.6) and p90 == pytest.approx(1.5)


def test_a_stack_is_ready_once_both_workers_have_reported():
    def worker(iteration: int) -> SimpleNamespace:
        return SimpleNamespace(iteration=iteration)

    assert not _reported([worker(3)])  # one registered
    assert not _reported([worker(3), worker(0)])  # both registered, one silent so far
    assert _reported([worker(3), worker(1)])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--turns", "1"], "--turns must be within 2-4, got 1"),
        (["--turns", "5"], "--turns must be within 2-4, got 5"),
        (["--conversations", "0"], "--conversations must be within 1-64, got 0"),
        (["--rounds", "0"], "--rounds must be at least 1, got 0"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(argv, message, capsys):
    assert refusal_line(main, argv, capsys).endswith(message)
