"""Late decisions on the core alone (docs/contract.md, "Late decisions"): a report with
`decide_later` is applied and answered with a decision that runs nothing; the worker's
next report gets the step's decision, and with it a prompt that arrived meanwhile."""

from __future__ import annotations

from dataclasses import replace

import pytest

from service.core import Scheduler, TokenUpdate
from service.core.persist.store import Disowned, MemoryStore

from .factories import FakeClock, admit, make_config, make_scheduler, register, report, submit


def _running_one():
    sched = make_scheduler()
    register(sched)
    first = submit(sched)
    assert admit(sched) == (first,)
    return sched, first


def test_a_report_that_decides_later_is_applied_and_answered_with_nothing_to_run():
    sched, first = _running_one()
    later = replace(report(running=[first]), tokens=(TokenUpdate(first, (7,)),), decide_later=True)
    decision = sched.select_batch(later)
    assert (decision.prefill, decision.decode, decision.evict, decision.preempt) == ((),) * 4
    assert sched.get_sequence(first).generated_tokens == 1  # the tokens were applied


def test_a_prompt_that_arrives_before_the_second_report_is_admitted_by_it():
    sched, first = _running_one()
    sched.select_batch(replace(report(running=[first]), decide_later=True))
    second = submit(sched)  # while the worker's step runs
    decision = sched.select_batch(report(running=[first]))
    assert decision.decode == (first,)
    assert [c.seq_id for c in decision.prefill] == [second]


def test_a_report_that_must_evict_is_decided_at_once():
    sched, first = _running_one()
    sched.cancel(first)
    decision = sched.select_batch(replace(report(running=[first]), decide_later=True))
    assert decision.evict == (first,)


def test_a_draining_worker_is_decided_at_once():
    sched, first = _running_one()
    decision = sched.select_batch(
        replace(report(running=[first], draining=True), decide_later=True)
    )
    assert decision.decode == (first,)


class _DisowningStore(MemoryStore):
    """A store whose next save with tokens fails for `armed`: another replica took
    them over (service/core/persist/store.py, Disowned)."""

    armed: frozenset[int] = frozenset()

    def save(self, changes):
        if self.armed and changes.tokens:
            seq_ids, self.armed = self.armed, frozenset()
            raise Disowned(seq_ids)
        super().save(changes)


def test_a_deferred_answer_runs_nothing_when_a_commit_disowns_a_sequence():
    # An answer with an evict only would be applied as the step's decision, which then
    # would not decode the sequence still this worker's; the next report evicts instead.
    store = _DisowningStore()
    sched = Scheduler(make_config(), clock=FakeClock(), store=store)
    register(sched)
    kept, taken = submit(sched), submit(sched)
    assert set(admit(sched)) == {kept, taken}
    tokens = (TokenUpdate(kept, (7,)), TokenUpdate(taken, (7,)))
    sched.select_batch(replace(report(running=[kept, taken]), tokens=tokens))
    store.armed = frozenset({taken})
    later = replace(
        report(running=[kept, taken]), tokens=(TokenUpdate(kept, (8,)),), decide_later=True
    )
    decision = sched.select_batch(later)
    assert (decision.prefill, decision.decode, decision.evict, decision.preempt) == ((),) * 4
    second = sched.select_batch(report(running=[kept, taken]))
    assert (second.decode, second.evict) == ((kept,), (taken,))


def test_a_deferred_report_is_not_a_call_between_steps():
    # A worker that asks twice a step (a deferred report, then the late one) calls once
    # a step for placement: its gap between calls is its step, not half of it on average.
    clock = FakeClock()
    sched = make_scheduler(clock)
    register(sched)
    first = submit(sched)
    assert admit(sched) == (first,)
    gaps = sched._ledger.get("w0").call_gaps
    for _ in range(6):
        clock.advance_ms(10)
        sched.select_batch(replace(report(running=[first]), decide_later=True))
        clock.advance_ms(190)
        sched.select_batch(report(running=[first]))
    assert gaps.mean_seconds == pytest.approx(0.2)
    assert gaps.deviation_seconds < 0.1 / 4  # gap / 2 at first, down a quarter each call
