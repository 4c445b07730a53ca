"""Scheduler.drain_worker: the operator's drain, on the core alone."""

from __future__ import annotations

import pytest

from service.core import UnknownWorker

from .factories import admit, make_scheduler, register, report, submit


def test_drain_worker_stops_admissions_until_resumed_and_counts_what_is_assigned():
    sched = make_scheduler()
    register(sched)
    first = submit(sched)
    assert admit(sched, gdn_free_slots=1) == (first,)
    second = submit(sched)
    assert sched.drain_worker("w0", resume=False) == 1
    decision = sched.select_batch(report(running=[first]))
    assert [c.seq_id for c in decision.prefill] == [] and decision.decode == (first,)
    assert sched.status().workers[0].draining is True
    assert sched.drain_worker("w0", resume=True) == 1
    decision = sched.select_batch(report(running=[first]))
    assert [c.seq_id for c in decision.prefill] == [second]
    assert sched.status().workers[0].draining is False


def test_drain_worker_of_an_unknown_worker_raises_unknown_worker():
    with pytest.raises(UnknownWorker, match="'ghost'"):
        make_scheduler().drain_worker("ghost", resume=False)
