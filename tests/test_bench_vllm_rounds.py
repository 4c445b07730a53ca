"""bench/vllm.py's decisions row over rounds: the order the stacks run in, the medians and
the targets' ratios, and the check that a stopped stack left nothing running."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.vllm import (
    DECISION_ROWS,
    LATTICE,
    Load,
    Request,
    _left_running,
    process_tree,
    round_order,
    stack_medians,
    target_ratios,
)


def test_over_three_rounds_each_stack_runs_once_first_once_in_the_middle_and_once_last():
    labels = list(DECISION_ROWS)
    orders = [round_order(labels, index) for index in range(3)]
    for position in range(3):
        assert sorted(order[position] for order in orders) == sorted(labels)
    assert orders[0] == labels  # one round: the order it always had


def _load(tokens_per_second: float, ttfts: list[float]) -> Load:
    """A load of one second whose requests made `tokens_per_second` tokens in all."""
    requests = [Request(ttft=t, tokens=1) for t in ttfts]
    requests[0].tokens += round(tokens_per_second) - len(requests)
    return Load(1.0, requests=requests)


def test_the_ratios_come_from_each_stacks_medians_not_from_one_rounds_figures():
    rr, pl = DECISION_ROWS[1], DECISION_ROWS[2]
    rounds = [
        {
            LATTICE: _load(400, [0.3] * 100),
            rr: _load(300, [0.5] * 100),
            pl: _load(380, [0.9] * 100),
        },
        {
            LATTICE: _load(350, [0.2] * 100),
            rr: _load(420, [0.6] * 100),
            pl: _load(390, [0.4] * 100),
        },
        {
            LATTICE: _load(450, [0.4] * 100),
            rr: _load(310, [0.7] * 100),
            pl: _load(410, [0.8] * 100),
        },
    ]
    medians = stack_medians(rounds)
    assert medians[LATTICE].tokens_per_second == pytest.approx(400)
    assert medians[rr].tokens_per_second == pytest.approx(310)
    assert medians[pl].tokens_per_second == pytest.approx(390)
    assert medians[pl].ttft_p99 == pytest.approx(0.8)
    throughput, p99 = target_ratios(medians)
    # The best router by median is prefix-load (390), though round-robin ran 420 once;
    # the best p99 by median is round-robin's 0.6, though prefix-load had 0.4 once.
    assert throughput == pytest.approx(400 / 390)
    assert p99 == pytest.approx(0.3 / 0.6)


def test_no_ratios_without_lattice_and_a_router():
    assert target_ratios(stack_medians([{LATTICE: _load(400, [0.3])}])) is None


def test_a_child_still_running_after_its_stack_stopped_is_found_and_one_that_ended_is_not():
    sleeper = "import time; time.sleep(30)"
    code = (
        f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {sleeper!r}]); {sleeper}"
    )
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        tree = {}
        for _ in range(100):  # until the grandchild is up
            tree = dict(process_tree(parent.pid))
            if len(tree) == 2:
                break
            subprocess.run(["sleep", "0.05"], check=True)
        assert len(tree) == 2 and parent.pid in tree
        parent.kill()  # as a server whose child outlives it
        parent.wait()
        left = _left_running(tree, 0.2)
        assert list(left) == [pid for pid in tree if pid != parent.pid]
    finally:
        for pid in tree:
            subprocess.run(["kill", "-9", str(pid)], capture_output=True)
    assert _left_running(tree, 1.0) == {}
