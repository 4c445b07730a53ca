"""Behaviour pinned while the core was split by concern: the save scope of each call, the
batch cap of a policy with a token budget, restoring a queued
sequence stored without its place, and queue orders chosen apart from batching."""

from __future__ import annotations

from dataclasses import replace

import pytest

from service.core import InvalidArgument, Scheduler, SequenceState
from service.core.decide.orders import ArrivalOrder, FairOrder, SortTerm, queue_order
from service.core.persist.store import MemoryStore, StateChanges, StoreError
from service.core.types import TokenUpdate

from .factories import FakeClock, admit, make_config, register, report, submit

# ----------------------------------------------------------------- save scope


def test_a_refused_report_still_saves_the_leases_it_expired():
    clock, store = FakeClock(), MemoryStore()
    sched = Scheduler(make_config(lease_ttl_ms=1000), clock=clock, store=store)
    register(sched, "w0")
    kept = submit(sched)
    assert admit(sched, "w0") == (kept,)
    register(sched, "w1")
    lost = submit(sched)
    assert admit(sched, "w1") == (lost,)
    clock.advance_ms(600)
    sched.select_batch(report("w0", waiting=[kept]))
    clock.advance_ms(600)  # w1 silent for 1.2 s: its lease ran out
    gap = TokenUpdate(seq_id=kept, token_ids=(7,), offset=5)
    with pytest.raises(InvalidArgument, match="offset 5 is beyond"):
        sched.select_batch(replace(report("w0", running=[kept]), tokens=(gap,)))
    restarted = Scheduler(make_config(lease_ttl_ms=1000), clock=clock, store=store)
    assert [w.worker_id for w in restarted.status().workers] == ["w0"]
    assert restarted.get_sequence(lost).state is SequenceState.QUEUED
    assert restarted.get_sequence(kept).worker_id == "w0"


def test_a_submit_whose_save_fails_leaves_no_trace_and_its_retry_queues_once():
    store = MemoryStore()
    sched = Scheduler(make_config(policy="fair"), clock=FakeClock(), store=store)
    store.fail_next_save = StoreError("disk full")
    with pytest.raises(StoreError):
        submit(sched, tenant="a")
    assert sched.status().queue_depth == 0
    seq_id = submit(sched, tenant="a")
    assert sched.get_sequence(seq_id).queue_position == 0
    restarted = Scheduler(make_config(policy="fair"), clock=FakeClock(), store=store)
    assert restarted.status().queue_depth == 1


# ----------------------------------------------------------------- policies


@pytest.mark.parametrize("policy, capped", [("fifo", False), ("budget", True), ("fair", True)])
def test_a_policy_with_a_token_budget_caps_the_batch_at_it(policy, capped):
    sched = Scheduler(
        make_config(policy=policy, max_batch_size=8, max_num_batched_tokens=16), clock=FakeClock()
    )
    settings = register(sched, "w0", max_batch_size=32)
    assert settings.max_batch_size == (16 if capped else 32)


def test_fair_is_budget_batching_over_the_fair_order():
    assert queue_order(make_config(policy="fair", aging_seconds=7.0)) == FairOrder(7.0)
    assert queue_order(make_config(policy="budget")) == ArrivalOrder()
    assert queue_order(make_config(policy="fifo")) == ArrivalOrder()
    assert Scheduler(make_config(policy="fair"), clock=FakeClock()).status().policy == "fair"


def test_every_sort_term_has_its_sql_in_the_postgres_store():
    pytest.importorskip("psycopg")
    from service.state.postgres import _ORDER_SQL

    assert set(_ORDER_SQL) == set(SortTerm)
    for order in (ArrivalOrder(), FairOrder(30.0)):
        assert order.sort_key[-1] is SortTerm.SEQ_ID  # a total order: ties by seq_id


# ----------------------------------------------------------------- recovery


def test_a_queued_sequence_stored_without_its_place_is_restored_behind_the_placed_ones():
    store = MemoryStore()
    sched = Scheduler(make_config(), clock=FakeClock(), store=store)
    first, second, third = submit(sched), submit(sched), submit(sched)
    # As an older schema saved it: queued, but without a queue key.
    progress = store.load().sequences[0].progress
    assert progress.seq_id == first
    store.save(StateChanges(progress=(replace(progress, queue_key=None),)))
    restarted = Scheduler(make_config(), clock=FakeClock(), store=store)
    positions = {s: restarted.get_sequence(s).queue_position for s in (first, second, third)}
    assert positions == {second: 0, third: 1, first: 2}
    later = submit(restarted)
    assert restarted.get_sequence(later).queue_position == 3
    register(restarted, "w0", max_batch_size=4)
    assert admit(restarted, "w0") == (second, third, first, later)
