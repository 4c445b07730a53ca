"""Durable state: what a store saves, and what a scheduler restarted on it carries on with.

Every restart here builds a new Scheduler over the store the old one saved to, as a
process restarted with the same --state-dir does. Each test runs on the in-memory
store and on SQLite.
"""

from __future__ import annotations

import pytest

from service.core import (
    ConfigError,
    FinishReason,
    QueueFull,
    Scheduler,
    SequenceState,
    UnknownWorker,
)
from service.core.persist.store import MemoryStore, StoreError
from service.state.sqlite import SqliteStateStore

from .factories import (
    FakeClock,
    admit,
    finished,
    make_config,
    params,
    register,
    report,
    submit,
    write_version_1_state_dir,
)


class Restartable:
    """A scheduler and its store, with restart() = a new process on the same state."""

    def __init__(self, kind: str, tmp_path, max_finished_retained: int = 100_000, **config) -> None:
        self.kind, self.tmp_path, self.config = kind, tmp_path, config
        self.max_finished_retained = max_finished_retained
        self.clock = FakeClock()
        self.store = self._open()
        self.sched = self._core()

    def _open(self):
        return MemoryStore() if self.kind == "memory" else SqliteStateStore(self.tmp_path)

    def _core(self) -> Scheduler:
        return Scheduler(
            make_config(**self.config),
            clock=self.clock,
            wall_clock=self.clock,
            store=self.store,
            max_finished_retained=self.max_finished_retained,
        )

    def restart(self) -> Scheduler:
        if self.kind == "sqlite":
            self.store.close()
            self.store = self._open()
        self.sched = self._core()
        return self.sched


@pytest.fixture(params=["memory", "sqlite"])
def kind(request):
    return request.param


@pytest.fixture
def state(kind, tmp_path):
    return Restartable(kind, tmp_path)


def queue_order(sched: Scheduler, seq_ids) -> list[int]:
    infos = [sched.get_sequence(s) for s in seq_ids]
    queued = [i for i in infos if i.state is SequenceState.QUEUED]
    return [i.seq_id for i in sorted(queued, key=lambda i: i.queue_position)]


def test_queue_comes_back_in_order_with_the_same_ids(state):
    ids = [submit(state.sched, prompt_len=3 + i) for i in range(5)]
    sched = state.restart()
    assert queue_order(sched, ids) == ids
    assert [sched.get_sequence(s).prompt_len for s in ids] == [3, 4, 5, 6, 7]
    assert sched.status().queue_depth == 5


def test_requeued_sequences_keep_their_place_at_the_head(state):
    ids = [submit(state.sched) for _ in range(4)]
    register(state.sched, "w0")
    first, second = admit(state.sched, "w0", gdn_free_slots=2)
    state.sched.select_batch(report("w0", running=[first], preempted=[second], gdn_free_slots=0))
    before = queue_order(state.sched, ids)
    assert before[0] == second
    assert queue_order(state.restart(), ids) == before


def test_request_id_idempotency_survives_a_restart(state):
    first = state.sched.submit(params(request_id="order-7")).seq_id
    sched = state.restart()
    again = sched.submit(params(request_id="order-7"))
    assert again.seq_id == first
    assert sched.status().queue_depth == 1


def test_ids_are_never_reused_after_a_restart(state):
    ids = [submit(state.sched) for _ in range(3)]
    state.sched.cancel(ids[-1])
    sched = state.restart()
    assert submit(sched) == ids[-1] + 1


def test_ids_are_never_reused_even_when_the_newest_were_forgotten(kind, tmp_path):
    state = Restartable(kind, tmp_path, max_finished_retained=1)
    ids = [submit(state.sched) for _ in range(3)]
    for seq_id in ids:
        state.sched.cancel(seq_id)
    sched = state.restart()
    assert submit(sched) == ids[-1] + 1


def test_cancel_and_finish_survive_a_restart(state):
    queued, running = submit(state.sched), submit(state.sched)
    register(state.sched, "w0")
    state.sched.cancel(queued)
    (admitted,) = admit(state.sched, "w0")
    assert admitted == running
    state.sched.select_batch(report("w0", running=[running], tokens={running: [7, 8]}))
    state.sched.select_batch(report("w0", finished=[finished(running, FinishReason.EOS, 2)]))
    sched = state.restart()
    assert sched.get_sequence(queued).finish_reason is FinishReason.CANCELLED
    info = sched.get_sequence(running)
    assert (info.state, info.finish_reason, info.generated_tokens) == (
        SequenceState.FINISHED,
        FinishReason.EOS,
        2,
    )
    assert sched.read_output(running, 0).token_ids == (7, 8)


def test_generated_tokens_survive_and_a_resume_continues_after_them(state):
    seq_id = submit(state.sched, prompt_len=4, max_new_tokens=6)
    register(state.sched, "w0")
    admit(state.sched, "w0")
    state.sched.select_batch(report("w0", running=[seq_id], tokens={seq_id: [50, 51]}))
    state.sched.select_batch(report("w0", running=[seq_id], tokens={seq_id: [52]}))
    sched = state.restart()
    assert sched.read_output(seq_id, 0).token_ids == (50, 51, 52)
    # The worker lost it meanwhile: it resumes elsewhere from prompt + 3 tokens.
    sched.select_batch(report("w0", gdn_free_slots=0))  # mentions nothing: lost
    register(sched, "w1")
    decision = sched.select_batch(report("w1"))
    (chunk,) = decision.prefill
    assert chunk.spec.prompt_token_ids == (1, 2, 3, 4, 50, 51, 52)
    assert chunk.spec.max_new_tokens == 3


def test_a_worker_that_still_holds_its_sequences_keeps_them(state):
    a, b = submit(state.sched, prompt_len=10), submit(state.sched, prompt_len=10)
    register(state.sched, "w0")
    admit(state.sched, "w0")
    state.sched.select_batch(report("w0", running=[a, b], tokens={a: [1], b: [2]}))
    sched = state.restart()
    # No RegisterWorker: the recovered worker just carries on.
    decision = sched.select_batch(report("w0", running=[a, b], tokens={a: [3], b: [4]}))
    assert list(decision.decode) == [a, b] and not decision.evict
    assert sched.read_output(a, 0).token_ids == (1, 3)
    assert sched.get_sequence(b).worker_id == "w0"


def test_what_the_worker_no_longer_holds_goes_back_to_the_head(state):
    queued = submit(state.sched)
    a, b = submit(state.sched), submit(state.sched)
    register(state.sched, "w0")
    state.sched.cancel(queued)
    admit(state.sched, "w0")
    later = submit(state.sched)
    sched = state.restart()
    decision = sched.select_batch(report("w0", running=[a], gdn_free_slots=0))
    assert list(decision.decode) == [a]
    assert queue_order(sched, [a, b, later]) == [b, later]


def test_a_prefill_in_progress_continues_from_its_cursor(kind, tmp_path):
    state = Restartable(kind, tmp_path, chunk_size=4)
    seq_id = submit(state.sched, prompt_len=10)
    register(state.sched, "w0")
    first = state.sched.select_batch(report("w0")).prefill[0]
    assert (first.chunk_start, first.chunk_len) == (0, 4)
    second = state.sched.select_batch(report("w0", waiting=[seq_id])).prefill[0]
    assert (second.chunk_start, second.chunk_len) == (4, 4)
    sched = state.restart()
    third = sched.select_batch(report("w0", waiting=[seq_id])).prefill[0]
    assert (third.seq_id, third.chunk_start, third.chunk_len, third.spec) == (seq_id, 8, 2, None)


def test_a_recovered_worker_that_never_calls_loses_its_sequences_at_the_lease(state):
    seq_id = submit(state.sched)
    register(state.sched, "w0")
    admit(state.sched, "w0")
    sched = state.restart()
    state.clock.advance_ms(sched.config.lease_ttl_ms + 1)
    assert sched.expire_leases() == ["w0"]
    assert sched.get_sequence(seq_id).state is SequenceState.QUEUED
    with pytest.raises(UnknownWorker):
        sched.select_batch(report("w0"))
    # ...and that survives another restart too.
    assert state.restart().get_sequence(seq_id).state is SequenceState.QUEUED


def test_deregistered_worker_is_not_recovered(state):
    register(state.sched, "w0")
    register(state.sched, "w1")
    state.sched.deregister_worker("w0")
    sched = state.restart()
    assert [w.worker_id for w in sched.status().workers] == ["w1"]


def test_a_re_registration_is_recovered_as_the_new_registration(state):
    register(state.sched, "w0", max_batch_size=2)
    register(state.sched, "w0", max_batch_size=5)
    ids = [submit(state.sched) for _ in range(6)]
    sched = state.restart()
    assert len(admit(sched, "w0")) == 5
    assert sched.status().queue_depth == len(ids) - 5


def test_an_operator_drain_survives_a_restart_until_resumed(state):
    register(state.sched, "w0")
    submit(state.sched)
    state.sched.drain_worker("w0", resume=False)
    sched = state.restart()
    assert [w.draining for w in sched.status().workers] == [True]
    assert admit(sched, "w0") == ()
    sched.drain_worker("w0", resume=True)
    assert len(admit(state.restart(), "w0")) == 1


def test_per_tenant_limit_survives_a_restart(kind, tmp_path):
    state = Restartable(kind, tmp_path, max_queue_per_tenant=2)
    submit(state.sched, tenant="a")
    submit(state.sched, tenant="a")
    sched = state.restart()
    with pytest.raises(QueueFull, match="tenant 'a'.*max_queue_per_tenant=2"):
        submit(sched, tenant="a")
    submit(sched, tenant="b")


# ----------------------------------------------------------------- store failures


def test_a_submit_the_store_refuses_is_not_accepted():
    store = MemoryStore()
    sched = Scheduler(make_config(), clock=FakeClock(), store=store)
    store.fail_next_save = StoreError("disk full")
    with pytest.raises(StoreError, match="disk full"):
        sched.submit(params(request_id="r1"))
    assert sched.status().queue_depth == 0
    # The request_id is free again, and the retry is saved.
    retried = sched.submit(params(request_id="r1")).seq_id
    restarted = Scheduler(make_config(), clock=FakeClock(), store=store)
    assert restarted.get_sequence(retried).state is SequenceState.QUEUED
    assert restarted.status().queue_depth == 1


def test_changes_of_a_failed_save_are_carried_by_the_next_one():
    store = MemoryStore()
    sched = Scheduler(make_config(), clock=FakeClock(), store=store)
    seq_id = submit(sched)
    register(sched, "w0")
    admit(sched, "w0")
    store.fail_next_save = StoreError("disk full")
    with pytest.raises(StoreError):
        sched.select_batch(report("w0", running=[seq_id], tokens={seq_id: [9, 9]}))
    sched.select_batch(report("w0", running=[seq_id], tokens={seq_id: [10]}))
    restarted = Scheduler(make_config(), clock=FakeClock(), store=store)
    assert restarted.read_output(seq_id, 0).token_ids == (9, 9, 10)


def test_submit_and_cancel_ask_for_a_synced_save_and_worker_calls_do_not():
    synced = []

    class Recording(MemoryStore):
        def save(self, changes):
            synced.append(changes.sync)
            super().save(changes)

    sched = Scheduler(make_config(), clock=FakeClock(), store=Recording())
    seq_id = submit(sched)
    register(sched, "w0")
    admit(sched, "w0")
    sched.cancel(seq_id)
    assert synced == [True, False, False, True]


def test_a_select_batch_that_changes_nothing_saves_nothing():
    store = MemoryStore()
    sched = Scheduler(make_config(), clock=FakeClock(), store=store)
    register(sched, "w0")
    saves = store.saves
    sched.select_batch(report("w0"))
    assert store.saves == saves


# ----------------------------------------------------------------- SQLite specifics


def test_one_state_dir_serves_one_scheduler(tmp_path):
    first = SqliteStateStore(tmp_path)
    with pytest.raises(ConfigError, match="in use by another scheduler"):
        SqliteStateStore(tmp_path)
    first.close()
    SqliteStateStore(tmp_path).close()


def test_sqlite_runs_in_wal_mode(tmp_path):
    store = SqliteStateStore(tmp_path)
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store.close()


def test_unknown_fsync_mode_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="state_fsync must be one of acks, always, never"):
        SqliteStateStore(tmp_path, fsync="sometimes")


def test_a_file_that_is_not_a_database_is_refused_clearly(tmp_path):
    (tmp_path / "scheduler.db").write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(ConfigError, match="not a usable SQLite database"):
        SqliteStateStore(tmp_path)


def test_tokens_params_and_registrations_round_trip_exactly(tmp_path):
    store = SqliteStateStore(tmp_path)
    sched = Scheduler(make_config(), clock=FakeClock(), store=store)
    p = params(
        prompt_len=5,
        max_new_tokens=7,
        request_id="ü-1",
        adapter_id="a",
        priority=-3,
        tenant="t",
        stop_token_ids=(2**32 - 1, 0),
    )
    seq_id = sched.submit(p).seq_id
    register(sched, "w0", adapters=("a",), max_batch_size=3)
    admit(sched, "w0")
    sched.select_batch(report("w0", running=[seq_id], tokens={seq_id: [0, 2**32 - 1]}))
    store.close()
    restored = SqliteStateStore(tmp_path).load()
    (seq,) = restored.sequences
    assert seq.params == p
    assert seq.output_token_ids == [0, 2**32 - 1]
    (worker,) = restored.workers
    registration = worker.registration
    assert (registration.worker_id, registration.adapters, registration.max_batch_size) == (
        "w0",
        ("a",),
        3,
    )


def test_the_token_log_is_emptied_as_sequences_finish(tmp_path):
    store = SqliteStateStore(tmp_path)
    sched = Scheduler(make_config(), clock=FakeClock(), store=store)
    a, b = submit(sched, max_new_tokens=3), submit(sched, max_new_tokens=3)
    register(sched, "w0")
    admit(sched, "w0")

    def log_rows() -> int:
        return store._db.execute("SELECT COUNT(*) FROM token_log").fetchone()[0]

    sched.select_batch(report("w0", running=[a, b], tokens={a: [1], b: [2]}))
    sched.select_batch(report("w0", running=[a, b], tokens={a: [3], b: [4]}))
    assert log_rows() == 2
    # a finishes: the rows still hold b's tokens.
    sched.select_batch(
        report(
            "w0", running=[b], tokens={a: [5]}, finished=[finished(a, FinishReason.MAX_LENGTH, 3)]
        )
    )
    assert log_rows() == 2
    sched.select_batch(
        report("w0", tokens={b: [6]}, finished=[finished(b, FinishReason.MAX_LENGTH, 3)])
    )
    assert log_rows() == 0
    store.close()
    restarted = Scheduler(make_config(), clock=FakeClock(), store=SqliteStateStore(tmp_path))
    assert restarted.read_output(a, 0).token_ids == (1, 3, 5)
    assert restarted.read_output(b, 0).token_ids == (2, 4, 6)


def test_log_rows_shared_with_forgotten_sequences_replay_and_free(tmp_path):
    """A long-running sequence shares log rows with ones that finish and are forgotten;
    a restart replays only what the unfinished one needs, and frees rows as before."""
    state = Restartable("sqlite", tmp_path, max_finished_retained=1)
    long, *short = [submit(state.sched, max_new_tokens=20) for _ in range(4)]
    register(state.sched, "w0")
    admit(state.sched, "w0")
    running = [long, *short]
    for step in range(3):
        state.sched.select_batch(
            report("w0", running=running, tokens={s: [100 * step + s] for s in running})
        )
    for seq_id in short:  # finish one by one: each forgets the one before
        running.remove(seq_id)
        state.sched.select_batch(
            report("w0", running=running, finished=[finished(seq_id, FinishReason.EOS, 3)])
        )
    sched = state.restart()
    assert sched.read_output(long, 0).token_ids == (long, 100 + long, 200 + long)
    sched.select_batch(report("w0", running=[long], tokens={long: [7]}))
    sched.select_batch(report("w0", finished=[finished(long, FinishReason.EOS, 4)]))
    rows = state.store._db.execute("SELECT COUNT(*) FROM token_log").fetchone()[0]
    assert rows == 0
    assert state.restart().read_output(long, 0).token_ids == (long, 100 + long, 200 + long, 7)


def test_after_a_failed_save_no_answer_rests_on_unsaved_state(tmp_path):
    state = Restartable("memory", tmp_path)  # failures are injected into the memory store
    seq_id = submit(state.sched)
    state.store.fail_next_save = StoreError("disk full")
    with pytest.raises(StoreError):
        state.sched.cancel(seq_id)
    # The retry saves the cancel before it answers (False: it is cancelled already).
    assert state.sched.cancel(seq_id) is False
    assert state.restart().get_sequence(seq_id).finish_reason is FinishReason.CANCELLED


def test_the_oldest_finished_are_forgotten_first_after_a_restart_too(kind, tmp_path):
    state = Restartable(kind, tmp_path, max_finished_retained=3)
    a = state.sched.submit(params(request_id="A")).seq_id
    b = state.sched.submit(params(request_id="B")).seq_id
    c = state.sched.submit(params(request_id="C")).seq_id
    for seq_id in (c, b, a):  # finish order differs from id order
        state.sched.cancel(seq_id)
    sched = state.restart()
    sched.cancel(submit(sched))  # one more finish: forgets c, the first to finish
    assert sched.submit(params(request_id="A")).seq_id == a
    assert sched.submit(params(request_id="B")).seq_id == b
    assert sched.submit(params(request_id="C")).seq_id != c


def test_the_time_waited_before_a_restart_still_counts_towards_aging(kind, tmp_path):
    state = Restartable(kind, tmp_path, policy="fair", aging_seconds=10.0)
    old = submit(state.sched, priority=4)
    state.clock.advance_ms(25_000)
    newer = submit(state.sched, priority=1)
    # Bands: old 4 - 2 = 2, newer 1 - 0 = 1.
    assert queue_order(state.sched, [old, newer]) == [newer, old]
    state.restart()
    assert queue_order(state.sched, [old, newer]) == [newer, old]
    state.clock.advance_ms(5_000)
    # old has waited 30 s in all (band 1), newer 5 s (band 1): the older goes first. Had
    # the restart reset old's wait, it would still be in band 4.
    assert queue_order(state.sched, [old, newer]) == [old, newer]


def test_a_version_1_state_dir_is_migrated_and_its_queue_kept(tmp_path):
    import sqlite3
    import time

    write_version_1_state_dir(tmp_path, {1: 3, 2: 1, 3: 2})  # queue order 2, 3, 1
    before = time.time()
    state = Restartable("sqlite", tmp_path)
    assert queue_order(state.sched, [1, 2, 3]) == [2, 3, 1]
    db = sqlite3.connect(tmp_path / "scheduler.db")
    assert db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (2,)
    # Dated at the migration: their waiting counts from then on.
    assert all(row[0] >= before for row in db.execute("SELECT submitted_at FROM sequences"))
    db.close()


def test_a_failed_sequences_reason_and_the_last_incarnation_survive_a_restart(state):
    sched = state.sched
    seq_id = submit(sched)
    register(sched, "gone")
    last = register(sched, "w0").incarnation
    sched.deregister_worker("gone")
    admit(sched, "w0")
    failure = finished(seq_id, FinishReason.FAILED)
    sched.select_batch(
        report(
            "w0",
            finished=[
                type(failure)(
                    seq_id,
                    FinishReason.FAILED,
                    0,
                    "token id 600 is outside the model's vocabulary of 512",
                )
            ],
        )
    )
    restarted = state.restart()
    info = restarted.get_sequence(seq_id)
    assert (info.finish_reason, info.error_message) == (
        FinishReason.FAILED,
        "token id 600 is outside the model's vocabulary of 512",
    )
    assert restarted.read_output(seq_id, 0).error_message == info.error_message
    assert [w.incarnation for w in restarted.status().workers] == [last]
    assert register(restarted, "new").incarnation == last + 1
