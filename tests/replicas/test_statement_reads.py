"""What the statements that run often read. A replica's keeper round (every third of a
lease, on every replica): the rows of the replicas that are gone and the queued sequences
with an adapter, not the whole `sequences` table, which holds every live sequence of the
fleet. A submit (thousands a second in a fleet): no queued sequence (the queue's size is
kept by triggers in `queue_counts`)."""

from __future__ import annotations

import psycopg
import pytest

from service.core import QueueFull
from service.core.persist.store import StateChanges
from service.state import postgres
from service.state.postgres import PostgresState
from tests.unit.factories import params

# A live replica's running sequences: what a keeper round must not read one by one.
LIVE_ROWS = 2_000


def _insert(url: str, count: int, *, owner: int | None, state: int, adapter: str = "") -> None:
    """`count` sequence rows (ids after the largest), as a fleet's table holds them."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO sequences (seq_id, params, prompt, priority, tenant, max_new_tokens, "
            "submitted_at, state, owner, adapter_id, queue_key) "
            "SELECT m.top + g, '{}', decode(repeat('01', 1024), 'hex'), 0, 't', 256, 0, "
            "%(state)s, %(owner)s, %(adapter)s, CASE WHEN %(state)s = 1 THEN m.top + g END "
            "FROM (SELECT coalesce(max(seq_id), 0) AS top FROM sequences) m, "
            "generate_series(1, %(count)s) g",
            {"state": state, "owner": owner, "adapter": adapter, "count": count},
        )
        conn.execute("SELECT setval('lattice_seq_ids', (SELECT max(seq_id) FROM sequences))")
        conn.execute(
            "SELECT setval('lattice_queue_tail', (SELECT coalesce(max(queue_key), 0) + 1 "
            "FROM sequences))"
        )
        conn.execute("ANALYZE sequences")
        # Its reads counted now, not when its backend exits (maybe inside a measurement).
        conn.execute("SELECT pg_stat_force_next_flush()")
        conn.execute("SELECT 1")


def _rows_read(state: PostgresState, url: str, call) -> int:
    """Rows and index entries of `sequences` that `call()` read through `state`'s one
    pooled connection (its backend's statistics flushed before and after)."""

    def flushed() -> int:
        with state._pool.connection() as conn:
            conn.execute("SELECT pg_stat_force_next_flush()")
            conn.execute("SELECT 1")  # answered once the statistics above are flushed
        with psycopg.connect(url, autocommit=True) as conn:
            (read,) = conn.execute(
                "SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) + (SELECT "
                "coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes WHERE relname = "
                "'sequences') FROM pg_stat_user_tables WHERE relname = 'sequences'"
            ).fetchone()
        return read

    before = flushed()
    call()
    return flushed() - before


@pytest.fixture
def stores(database_url):
    made: list[PostgresState] = []

    def make(name: str, **kwargs) -> PostgresState:
        store = PostgresState(database_url, name=name, **kwargs)
        made.append(store)
        return store

    with psycopg.connect(database_url, autocommit=True) as conn:
        if conn.execute("SELECT to_regproc('pg_stat_force_next_flush')").fetchone()[0] is None:
            pytest.skip("PostgreSQL before 15 cannot flush a backend's statistics on demand")
    yield make
    for store in made:
        store.close()


def test_a_keeper_round_reads_no_row_of_a_live_replica(stores, database_url):
    live = stores("live")
    keeper = stores("keeper", pool_size=1)
    _insert(database_url, LIVE_ROWS, owner=live.replica_id, state=3)
    assert _rows_read(keeper, database_url, keeper.reclaim_expired) < 20


def test_a_gone_replicas_finished_sequences_lose_their_owner_a_bounded_batch_a_round(
    stores, database_url, monkeypatch
):
    """A gone replica's unfinished sequences go back at once; its finished ones (a core
    retains up to 100,000) lose their owner a batch a round, outside the requeue's
    transaction, and then no round reads them again."""
    monkeypatch.setattr(postgres, "FINISHED_OWNERS_A_ROUND", 120)
    gone, live = stores("gone"), stores("live")
    keeper = stores("keeper", pool_size=1)
    _insert(database_url, LIVE_ROWS, owner=live.replica_id, state=3)
    _insert(database_url, 300, owner=gone.replica_id, state=4)
    _insert(database_url, 3, owner=gone.replica_id, state=3)
    gone.leave()

    def still_owned() -> list[tuple[int, int]]:
        with psycopg.connect(database_url) as conn:
            return conn.execute(
                "SELECT state, count(*) FROM sequences WHERE owner = %s GROUP BY state",
                (gone.replica_id,),
            ).fetchall()

    assert keeper.reclaim_expired() == 3
    assert still_owned() == [(4, 180)]
    assert keeper.reclaim_expired() == 0
    assert still_owned() == [(4, 60)]
    assert keeper.reclaim_expired() == 0
    assert still_owned() == []
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT count(*) FROM sequences WHERE state = 4").fetchone() == (300,)
    keeper.reclaim_expired()  # walks the owner index's dead entries once, marking them
    assert _rows_read(keeper, database_url, keeper.reclaim_expired) < 20


def test_the_fleet_wide_unservable_count_reads_only_queued_sequences_with_an_adapter(
    stores, database_url
):
    keeper = stores("keeper", pool_size=1)
    _insert(database_url, LIVE_ROWS, owner=None, state=1)
    _insert(database_url, 2, owner=None, state=1, adapter="nobody-has-it")
    counted: list[int] = []
    read = _rows_read(keeper, database_url, lambda: counted.append(keeper.unservable_queued()))
    assert counted == [2]
    assert read < 20


def test_a_replica_back_from_a_lapsed_lease_still_drops_the_finished_sequences_it_forgets(
    stores, database_url
):
    lapsed, keeper = stores("lapsed"), stores("keeper")
    _insert(database_url, 3, owner=lapsed.replica_id, state=4)
    with psycopg.connect(database_url, autocommit=True) as conn:
        seq_ids = [row[0] for row in conn.execute("SELECT seq_id FROM sequences ORDER BY 1")]
        conn.execute(
            "UPDATE replicas SET lease_until = now() - interval '1 second' WHERE replica_id = %s",
            (lapsed.replica_id,),
        )
    keeper.reclaim_expired()  # its row goes, and its finished rows lose their owner
    assert lapsed.renew_lease() is False  # back, under a new row
    lapsed.save(StateChanges(forgotten=tuple(seq_ids)))
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT count(*) FROM sequences").fetchone() == (0,)


def test_a_submit_reads_no_queued_sequence(stores, database_url):
    """The queue's size for its limit and the new sequence's position comes from the
    counts the triggers keep (counting the queue read each queued sequence, twice: at a
    fleet's queue, most of a submit's cost)."""
    submitter = stores("submitter", pool_size=1)
    _insert(database_url, LIVE_ROWS, owner=None, state=1)
    submitted = []
    read = _rows_read(
        submitter,
        database_url,
        lambda: submitted.append(submitter.submit(params(max_new_tokens=8), 10**6, 0)),
    )
    assert submitted[0].queue_position == LIVE_ROWS
    assert read < 20
    assert submitter.queue_depth() == LIVE_ROWS + 1
    with pytest.raises(QueueFull):
        submitter.submit(params(max_new_tokens=8), LIVE_ROWS + 1, 0)


def test_the_queues_kept_size_survives_a_truncate_and_writes_past_its_triggers(
    stores, database_url
):
    """What empties or fills `sequences` past the row triggers (TRUNCATE; a restore with
    session_replication_role = replica) would leave every submit measured against a wrong
    size: a TRUNCATE resets it, and a replica's start recounts it."""
    first = stores("first")
    for _ in range(5):
        first.submit(params(max_new_tokens=8), 5, 0)
    with pytest.raises(QueueFull):
        first.submit(params(max_new_tokens=8), 5, 0)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("TRUNCATE sequences")
    assert first.submit(params(max_new_tokens=8), 5, 0).queue_position == 0
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("SET session_replication_role = replica")
        conn.execute(
            "INSERT INTO sequences (seq_id, params, prompt, priority, tenant, max_new_tokens, "
            "submitted_at, state, queue_key) SELECT nextval('lattice_seq_ids'), '{}', "
            "'\\x01000000', 0, 't', 8, 0, 1, nextval('lattice_queue_tail') "
            "FROM generate_series(1, 3)"
        )
    assert first.queue_depth() == 1  # the triggers did not see those three
    assert stores("second").queue_depth() == 4
    assert first.submit(params(max_new_tokens=8), 10, 0).queue_position == 4
