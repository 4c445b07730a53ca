"""The PostgreSQL store against a real private cluster: submit, claims, saves that are
refused once ownership moved, leases and their expiry, cancels across replicas."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import psycopg
import pytest

from service.core import FinishReason, QueueFull, ReplicaScheduler, SequenceState
from service.core.decide.orders import queue_order
from service.core.persist.store import Disowned, SequenceProgress, StateChanges
from service.core.types import TokenUpdate
from service.state.postgres import PostgresState
from tests.unit.factories import (
    FakeClock,
    finished,
    make_config,
    params,
    register,
    report,
)


class Replica:
    """One replica's store and core, driven by hand (no threads)."""

    def __init__(
        self, url: str, name: str, policy: str = "fifo", lease_ttl: float = 5.0, **config
    ) -> None:
        config = make_config(policy=policy, **config)
        self.state = PostgresState(
            url, name=name, lease_ttl_seconds=lease_ttl, order=queue_order(config)
        )
        self.clock = FakeClock()
        self.core = ReplicaScheduler(
            config, clock=self.clock, wall_clock=lambda: self.clock() + 1.7e9, store=self.state
        )

    def submit(self, **overrides) -> int:
        return self.state.submit(params(**overrides), 1000, 0).seq_id

    def claim(self, count: int = 100) -> list[int]:
        claimed = self.state.claim(count)
        return self.core.adopt(claimed.sequences)


@pytest.fixture
def replicas(database_url):
    made = []

    def make(name: str, **kwargs) -> Replica:
        replica = Replica(database_url, name, **kwargs)
        made.append(replica)
        return replica

    yield make
    for replica in made:
        replica.state.close()


def test_submit_commits_ids_from_one_sequence_and_request_ids_are_unique_across_replicas(replicas):
    a, b = replicas("a"), replicas("b")
    first = a.state.submit(params(request_id="r1"), 1000, 0)
    again = b.state.submit(params(request_id="r1"), 1000, 0)
    other = b.state.submit(params(request_id="r2"), 1000, 0)
    assert again.seq_id == first.seq_id
    assert other.seq_id > first.seq_id
    assert (first.queue_position, other.queue_position) == (0, 1)
    assert a.state.queue_depth() == 2


def test_submit_beyond_max_queue_is_refused_but_a_known_request_id_is_answered(replicas):
    a = replicas("a")
    a.state.submit(params(request_id="r1"), 1, 0)
    with pytest.raises(QueueFull, match="max_queue=1"):
        a.state.submit(params(request_id="r2"), 1, 0)
    assert a.state.submit(params(request_id="r1"), 1, 0).seq_id == 1


def test_claims_are_exclusive_and_in_queue_order(replicas):
    a, b = replicas("a"), replicas("b")
    ids = [a.submit() for _ in range(6)]
    assert a.claim(2) == ids[:2]
    assert b.claim(3) == ids[2:5]
    assert a.claim(10) == ids[5:]
    assert b.claim(10) == []


def test_concurrent_claims_never_take_one_sequence_twice(replicas, database_url):
    a = replicas("a")
    ids = {a.submit() for _ in range(60)}
    stores = [PostgresState(database_url, name=f"c{i}") for i in range(4)]
    taken: list[list[int]] = [[] for _ in stores]

    def claim_all(i: int) -> None:
        while True:
            got = [s.seq_id for s in stores[i].claim(3).sequences]
            if not got:
                return
            taken[i].extend(got)

    threads = [threading.Thread(target=claim_all, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    flat = [s for got in taken for s in got]
    assert sorted(flat) == sorted(ids)
    for store in stores:
        store.close()


def test_fair_claims_follow_bands_then_tenant_service(replicas, database_url):
    a = replicas("a", policy="fair")
    low = a.submit(priority=5, tenant="t1")
    urgent = a.submit(priority=0, tenant="t1")
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("INSERT INTO tenant_service VALUES ('busy', 1000), ('idle', 1)")
    busy = a.submit(priority=1, tenant="busy")
    idle = a.submit(priority=1, tenant="idle")
    assert [a.claim(1)[0] for _ in range(4)] == [urgent, idle, busy, low]


def test_a_replica_saves_progress_and_tokens_that_another_replica_reads(replicas):
    a, b = replicas("a"), replicas("b")
    seq_id = b.submit(max_new_tokens=3)
    register(a.core)
    a.claim()
    a.core.select_batch(report())
    a.core.select_batch(report(running=(seq_id,), tokens={seq_id: (7, 8)}))
    out = b.state.read_output(seq_id, 0)
    assert (out.token_ids, out.finished) == ((7, 8), False)
    assert b.state.read_output(seq_id, 1).token_ids == (8,)
    a.core.select_batch(
        report(tokens={seq_id: (9,)}, finished=(finished(seq_id, FinishReason.EOS, 3),))
    )
    out = b.state.read_output(seq_id, 2)
    assert (out.token_ids, out.finished, out.finish_reason) == ((9,), True, FinishReason.EOS)
    info = b.state.sequence_info(seq_id)
    assert (info.state, info.generated_tokens) == (SequenceState.FINISHED, 3)


def test_a_worker_registering_elsewhere_takes_its_sequences_and_the_old_owner_is_refused(replicas):
    a, b = replicas("a"), replicas("b")
    seq_id = a.submit(max_new_tokens=8)
    register(a.core, "w")
    a.claim()
    a.core.select_batch(report("w"))
    a.core.select_batch(report("w", running=(seq_id,), tokens={seq_id: (5,)}))
    register(b.core, "w")
    moved = b.state.adopt_worker("w")
    assert b.core.adopt(moved.sequences, "w") == [seq_id]
    # The worker keeps it: its report on b carries on from the saved token.
    decision = b.core.select_batch(
        replace(report("w", running=(seq_id,)), tokens=(TokenUpdate(seq_id, (6,), offset=1),))
    )
    assert decision.decode == (seq_id,)
    assert b.state.read_output(seq_id, 0).token_ids == (5, 6)
    # a's next call about it is refused by the store; a forgets it and evicts it.
    decision = a.core.select_batch(
        replace(report("w", running=(seq_id,)), tokens=(TokenUpdate(seq_id, (99,), offset=1),))
    )
    assert seq_id not in a.core.owned_seq_ids()
    assert decision.decode == ()
    assert b.state.read_output(seq_id, 0).token_ids == (5, 6)


def test_a_save_touching_a_sequence_owned_elsewhere_applies_nothing(replicas, database_url):
    a, b = replicas("a"), replicas("b")
    first, second = a.submit(), a.submit()
    a.claim()
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE sequences SET owner = %s WHERE seq_id = %s", (b.state.replica_id, second)
        )
    a.core.cancel(first)  # saved; the other one is not touched
    assert a.state.sequence_info(first).finish_reason is FinishReason.CANCELLED
    a.core.cancel(second)  # refused by the store: the core gives it up
    assert a.core.owned_seq_ids() == set()
    assert a.state.sequence_info(second).state is SequenceState.QUEUED
    with pytest.raises(Disowned) as raised:
        a.state.save(
            StateChanges(
                progress=(
                    SequenceProgress(
                        second, SequenceState.FINISHED, None, None, 0, 0, 0, 0, FinishReason.EOS
                    ),
                )
            )
        )
    assert raised.value.seq_ids == {second}


def test_an_expired_lease_returns_claims_in_place_and_assigned_to_the_head(replicas):
    a, b = replicas("a", lease_ttl=0.2), replicas("b")
    ids = [b.submit(max_new_tokens=8) for _ in range(4)]
    register(a.core, "w", max_batch_size=1)
    assert a.claim(3) == ids[:3]
    a.core.select_batch(report("w"))  # admits ids[0]
    a.core.select_batch(report("w", running=(ids[0],), tokens={ids[0]: (4, 4)}))
    time.sleep(0.5)
    assert b.state.reclaim_expired() == 3
    register(b.core, "v", max_batch_size=8)
    assert b.claim() == [ids[0], ids[1], ids[2], ids[3]]
    decision = b.core.select_batch(report("v"))
    assert decision.prefill[0].seq_id == ids[0]
    assert decision.prefill[0].spec.prompt_token_ids[-2:] == (4, 4)
    assert decision.prefill[0].spec.max_new_tokens == 6
    # a comes back: its lease is gone (the replica then gives up what it no longer
    # owns), and its worker is told to evict what b runs now.
    assert a.state.renew_lease() is False
    a.core.disown(a.core.owned_seq_ids() - a.state.owned_ids())
    assert a.core.owned_seq_ids() == set()
    assert a.core.select_batch(report("w", running=(ids[0],))).evict == (ids[0],)


def test_cancel_of_a_sequence_another_replica_owns_is_committed_and_signalled(replicas):
    a, b = replicas("a"), replicas("b")
    seq_id = a.submit()
    unclaimed = a.submit()
    a.claim(1)
    assert b.state.cancel(unclaimed) is True
    assert b.state.sequence_info(unclaimed).finish_reason is FinishReason.CANCELLED
    assert b.state.cancel(seq_id) is True
    assert a.state.cancel_requests() == [seq_id]
    a.core.cancel(seq_id)
    assert a.state.cancel_requests() == []
    assert b.state.cancel(seq_id) is False


def test_commits_submits_and_claims_notify_no_one_and_a_cancel_of_an_unclaimed_one_does(
    replicas,
):
    # PostgreSQL wakes every listening backend at each NOTIFY: a commit moves its
    # replica's number instead (streams elsewhere read it), a submit adds a seq_id the
    # watchers read, a claim gives an owner that the watchers read for the streams that
    # wait on it, while a cancel of an unclaimed sequence (nothing a watcher reads shows
    # it) still notifies its id.
    a, b = replicas("a"), replicas("b")
    listener = b.state.listen_connection()
    seq_id = a.submit()
    unclaimed = a.submit()
    register(a.core)
    a.claim(1)
    before = b.state.watch(listener).marks[a.state.replica_id]
    a.core.select_batch(report())  # admits seq_id
    a.core.select_batch(report(running=(seq_id,), tokens={seq_id: (1,)}))
    assert b.state.watch(listener).marks[a.state.replica_id] >= before + 2
    assert b.state.cancel(unclaimed) is True
    seen = [(n.channel, n.payload) for n in listener.notifies(timeout=1.0)]
    listener.close()
    assert seen == [("lattice_progress", str(unclaimed))]


def test_a_submit_the_database_cannot_hold_is_invalid_argument_not_unavailable(replicas):
    # The edge refuses a NUL in every string (tests/server/test_string_fields.py); should
    # one reach the store, the refusal is for this request only, and not retryable.
    from service.core import InvalidArgument

    a = replicas("a")
    with pytest.raises(InvalidArgument, match="cannot hold this request"):
        a.state.submit(params(tenant="nul\x00byte"), 1000, 0)
    assert a.submit(tenant="t") > 0


def test_unclaimed_tokens_count_as_urgent_unclaimed_prompts_and_live_replicas(replicas):
    a, b = replicas("a"), replicas("b")
    a.submit(prompt_len=100, priority=-1)
    a.submit(prompt_len=30, priority=0)
    a.submit(prompt_len=7, priority=2)
    assert a.state.unclaimed_tokens_up_to(-1) == (100, 2)
    assert b.state.unclaimed_tokens_up_to(0) == (130, 2)
    a.claim(1)  # the first, claimed: no longer the shared queue's
    assert a.state.unclaimed_tokens_up_to(5) == (37, 2)


def test_a_watch_reading_sees_the_newest_seq_id_and_which_of_those_asked_are_there(replicas):
    a, b = replicas("a"), replicas("b")
    conn = b.state.watch_connection()
    first = b.state.watch(conn)
    assert first.marks == {a.state.replica_id: 0} and first.filled == ()
    ids = [a.submit() for _ in range(3)]
    later = b.state.watch(conn, (ids[1], ids[-1] + 50))
    assert later.newest == ids[-1] > first.newest
    assert later.filled == (ids[1],)  # one that never came is not there
    conn.close()


def test_a_watch_reading_sees_which_unclaimed_sequences_have_an_owner_now(replicas):
    a, b = replicas("a"), replicas("b")
    conn = b.state.watch_connection()
    ids = [a.submit() for _ in range(3)]
    assert b.state.watch(conn, (), ids).claimed == ()
    a.claim(2)  # the first two, in the queue's order
    later = b.state.watch(conn, (ids[-1] + 50,), [*ids, ids[-1] + 60])
    assert later.claimed == (ids[0], ids[1])
    assert later.filled == ()  # those asked as pending are told apart
    conn.close()
