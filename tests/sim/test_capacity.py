"""The capacity search: doubling or halving to the edge, then bisection to the tolerance."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from service.sim.experiments import MAX_DOUBLINGS, Slo, find_capacity


@dataclass(frozen=True)
class _Result:
    qps: float
    ttft_p99: float
    tpot_p99: float


@dataclass(frozen=True)
class _Run:
    result: _Result


def runs_meeting_up_to(limit: float):
    """A system whose TTFT p99 crosses 2 s at `limit` QPS."""
    asked = []

    def run_at(qps: float) -> _Run:
        asked.append(qps)
        return _Run(_Result(qps, 2.0 * qps / limit, 0.05))

    return run_at, asked


@pytest.mark.parametrize("limit, start", [(5.3, 1.0), (5.3, 40.0), (0.7, 1.0)])
def test_capacity_is_the_highest_passing_rate_within_the_tolerance(limit, start):
    run_at, asked = runs_meeting_up_to(limit)
    steps = []
    capacity = find_capacity(
        run_at,
        Slo(2.0, 0.1),
        start_qps=start,
        on_step=lambda n, run, meets: steps.append((n, run.result.qps, meets)),
    )
    assert limit / 1.05 <= capacity.capacity_qps <= limit
    failing = [qps for _, qps, meets in steps if not meets]
    assert min(failing) <= capacity.capacity_qps * 1.05 + 1e-9
    assert [n for n, _, _ in steps] == list(range(1, len(asked) + 1))
    assert len(capacity.runs) == len(asked)


def test_capacity_is_zero_when_nothing_meets_the_slo():
    run_at, asked = runs_meeting_up_to(1e-9)
    assert find_capacity(run_at, Slo(2.0, 0.1), start_qps=1.0).capacity_qps == 0.0
    assert len(asked) == MAX_DOUBLINGS + 1


def test_the_search_stops_at_its_highest_rate_when_everything_meets_the_slo():
    run_at, asked = runs_meeting_up_to(1e9)
    capacity = find_capacity(run_at, Slo(2.0, 0.1), start_qps=1.0)
    assert capacity.capacity_qps == 2.0**MAX_DOUBLINGS
