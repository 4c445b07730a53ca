"""A change the store refuses for its data (not for being unreachable) is not retried on
every later save: the sequences it names are failed with an error that says so, the
rest is saved, and a change it refuses whatever sequences go is dropped."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from service.core import FinishReason, Scheduler, SequenceState
from service.core.persist.store import MemoryStore, Refused, StateChanges

from .factories import FakeClock, make_config, params, register, report

BAD_TENANT = "refused-by-store"
BAD_MESSAGE = "refused-by-store"


class PickyStore(MemoryStore):
    """Refuses a change that holds a sequence of BAD_TENANT, a FAILED finish whose message
    holds BAD_MESSAGE (naming those sequences), or a worker named BAD_TENANT (naming
    none); otherwise a MemoryStore. Counts its refusals."""

    def __init__(self) -> None:
        super().__init__()
        self.refusals = 0

    def save(self, changes: StateChanges) -> None:
        bad = {seq_id for seq_id, p in changes.created if p.tenant == BAD_TENANT}
        bad |= {p.seq_id for p in changes.progress if BAD_MESSAGE in (p.error_message or "")}
        if bad:
            self.refusals += 1
            raise Refused(f"value not allowed in {sorted(bad)}", frozenset(bad))
        if any(w.registration.worker_id == BAD_TENANT for w in changes.workers_changed):
            self.refusals += 1
            raise Refused("worker_id not allowed")
        super().save(changes)


def _scheduler(store: PickyStore) -> Scheduler:
    return Scheduler(make_config(), clock=FakeClock(), store=store)


def test_a_submit_the_store_refuses_fails_that_sequence_once_and_the_rest_goes_on():
    """Before: the refused change was kept and saved first on every later call, so every
    later call failed (UNAVAILABLE) until restart."""
    store = PickyStore()
    sched = _scheduler(store)
    register(sched)
    good = sched.submit(params()).seq_id
    bad = sched.submit(params(tenant=BAD_TENANT)).seq_id
    later = sched.submit(params()).seq_id
    sched.select_batch(report())
    info = sched.get_sequence(bad)
    assert info.finish_reason is FinishReason.FAILED
    assert "state store refused to save this sequence" in info.error_message
    assert store.refusals == 1
    stored = {s.seq_id for s in store.load().sequences}
    assert stored == {good, later}
    assert sched.get_sequence(later).state is not SequenceState.QUEUED  # admitted


def test_a_finish_message_the_store_refuses_is_replaced_and_the_failure_saved():
    store = PickyStore()
    sched = _scheduler(store)
    register(sched)
    seq_id = sched.submit(params()).seq_id
    sched.select_batch(report())
    sched.select_batch(_failed_report(seq_id, BAD_MESSAGE))
    info = sched.get_sequence(seq_id)
    assert info.finish_reason is FinishReason.FAILED
    assert "state store refused" in info.error_message and BAD_MESSAGE not in info.error_message
    (stored,) = store.load().sequences
    assert stored.progress.finish_reason is FinishReason.FAILED
    sched.select_batch(report())  # and the next call saves as usual
    assert store.refusals == 1


def test_a_change_refused_whatever_sequences_go_is_dropped_not_retried():
    store = PickyStore()
    sched = _scheduler(store)
    register(sched, BAD_TENANT)
    seq_id = sched.submit(params()).seq_id
    assert store.refusals == 1  # the registration's change, dropped; not tried again
    assert sched.get_sequence(seq_id).state is SequenceState.QUEUED
    assert [s.seq_id for s in store.load().sequences] == [seq_id]


def _failed_report(seq_id: int, message: str):
    from dataclasses import replace

    from service.core.types import FinishedSequence

    return replace(report(), finished=(FinishedSequence(seq_id, FinishReason.FAILED, 0, message),))


@settings(max_examples=60, deadline=None)
@given(
    calls=st.lists(
        st.sampled_from(["submit", "submit_bad", "report", "finish", "finish_bad"]),
        min_size=1,
        max_size=25,
    )
)
def test_whatever_the_store_refuses_every_later_call_succeeds_and_the_good_state_is_saved(
    calls,
):
    """Property: a mix of submits, reports and finishes, some with data the store
    refuses: no call fails, each refused sequence is FAILED with the store's refusal, and
    the store holds every other sequence as the scheduler does."""
    store = PickyStore()
    sched = _scheduler(store)
    register(sched)
    bad: set[int] = set()
    for call in calls:
        if call.startswith("submit"):
            seq_id = sched.submit(params(tenant=BAD_TENANT if call == "submit_bad" else "")).seq_id
            if call == "submit_bad":
                bad.add(seq_id)
        elif call == "report":
            sched.select_batch(report())
        else:
            held = sorted(sched._tables.ledger.get("w0").assigned)
            if held:
                message = BAD_MESSAGE if call == "finish_bad" else "engine error"
                sched.select_batch(_failed_report(held[0], message))
                if call == "finish_bad":
                    bad.add(held[0])
    sched.select_batch(report())
    for seq_id in bad:
        info = sched.get_sequence(seq_id)
        assert info.finish_reason is FinishReason.FAILED
        assert "state store refused" in info.error_message
    stored = {s.seq_id: s for s in store.load().sequences}
    for seq in sched._tables.sequences._by_id.values():
        if seq.seq_id in bad and seq.params.tenant == BAD_TENANT:
            assert seq.seq_id not in stored  # never saved: its creation was refused
        else:
            assert stored[seq.seq_id].progress.state is seq.state
