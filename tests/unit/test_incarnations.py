"""Worker incarnations in the core: every registration gets a new number, calls from an older
one are refused and change nothing, 0 means the latest, numbers survive a restart."""

from __future__ import annotations

from dataclasses import replace

import pytest

from service.core import InvalidArgument, Scheduler, SequenceState, Superseded, UnknownWorker
from service.core.persist.store import MemoryStore
from tests.unit.factories import (
    FakeClock,
    admit,
    finished,
    make_config,
    make_scheduler,
    register,
    registration,
    report,
    submit,
)


def _with_incarnation(r, incarnation):
    return replace(r, incarnation=incarnation)


def test_every_registration_of_any_worker_gets_a_higher_incarnation():
    sched = make_scheduler()
    numbers = [register(sched, w).incarnation for w in ("a", "b", "a", "c", "a")]
    assert numbers == sorted(numbers) and len(set(numbers)) == 5 and numbers[0] >= 1


def test_select_batch_from_an_older_incarnation_is_superseded_and_changes_nothing():
    sched = make_scheduler()
    old = register(sched).incarnation
    seq_id = submit(sched)
    new = register(sched).incarnation  # a second process with the same worker_id
    assert admit(sched, incarnation=new) == (seq_id,)
    before = sched.get_sequence(seq_id), sched.status()

    stale = _with_incarnation(
        report(running=[seq_id], tokens={seq_id: [5, 6]}, finished=[finished(seq_id)]), old
    )
    with pytest.raises(
        Superseded,
        match=rf"^superseded: .*incarnation {old} was replaced "
        rf"by incarnation {new}",
    ):
        sched.select_batch(stale)

    info, status = sched.get_sequence(seq_id), sched.status()
    assert info == before[0] and info.state is SequenceState.PREFILLING
    assert sched.read_output(seq_id, 0).token_ids == ()
    assert status.workers[0].iteration == before[1].workers[0].iteration


def test_incarnation_zero_means_the_latest():
    sched = make_scheduler()
    register(sched)
    seq_id = submit(sched)
    register(sched)
    assert admit(sched) == (seq_id,)  # the factories' reports carry incarnation 0


def test_deregister_from_an_older_incarnation_is_superseded_and_keeps_the_worker():
    sched = make_scheduler()
    old = register(sched).incarnation
    new = register(sched).incarnation
    seq_id = submit(sched)
    admit(sched, incarnation=new)
    with pytest.raises(Superseded):
        sched.deregister_worker("w0", old)
    assert [w.worker_id for w in sched.status().workers] == ["w0"]
    assert sched.get_sequence(seq_id).worker_id == "w0"
    assert sched.deregister_worker("w0", new) == 1


def test_an_incarnation_newer_than_the_registered_one_must_register_again():
    sched = make_scheduler()
    current = register(sched).incarnation
    with pytest.raises(UnknownWorker, match="call RegisterWorker again"):
        sched.select_batch(_with_incarnation(report(), current + 1))


def test_status_shows_each_workers_incarnation():
    sched = make_scheduler()
    a = register(sched, "a").incarnation
    b = register(sched, "b").incarnation
    assert {w.worker_id: w.incarnation for w in sched.status().workers} == {"a": a, "b": b}


def test_incarnations_are_never_reused_after_a_restart_even_of_departed_workers():
    store = MemoryStore()
    sched = Scheduler(make_config(), clock=FakeClock(), store=store)
    kept = sched.register_worker(registration("kept")).incarnation
    last = sched.register_worker(registration("gone")).incarnation
    sched.deregister_worker("gone")
    restarted = Scheduler(make_config(), clock=FakeClock(), store=store)
    # The recovered worker keeps its number: its process carries on with it.
    assert restarted.status().workers[0].incarnation == kept
    assert restarted.register_worker(registration("new")).incarnation == last + 1


def test_a_recovered_worker_calling_with_its_incarnation_carries_on():
    store = MemoryStore()
    sched = Scheduler(make_config(), clock=FakeClock(), store=store)
    number = sched.register_worker(registration("w0")).incarnation
    seq_id = submit(sched)
    admit(sched, incarnation=number)
    restarted = Scheduler(make_config(), clock=FakeClock(), store=store)
    decision = restarted.select_batch(_with_incarnation(report(waiting=[seq_id]), number))
    assert [c.seq_id for c in decision.prefill] == [seq_id]


def test_a_registration_asking_for_more_than_max_worker_batch_size_gets_the_cap():
    sched = make_scheduler(max_worker_batch_size=64)
    assert register(sched, max_batch_size=2**32 - 1).max_batch_size == 64
    assert register(sched, "b", max_batch_size=10).max_batch_size == 10
    for _ in range(100):
        submit(sched)
    assert len(admit(sched)) == 64


def test_report_checks_come_after_the_incarnation_check():
    """A superseded process's malformed report is refused as superseded, not as malformed."""
    sched = make_scheduler()
    old = register(sched).incarnation
    register(sched)
    with pytest.raises(Superseded):
        sched.select_batch(_with_incarnation(report(waiting=[1, 1]), old))
    with pytest.raises(InvalidArgument):
        sched.select_batch(report(waiting=[1, 1]))
