"""Schema 5: a replica counts the tokens of the sequences it runs in one row of its own
(`replica_counts`), not in each sequence's row, and GetSequence reads on from that row.
Against a real private cluster."""

from __future__ import annotations

import threading

import psycopg
import pytest

from service.core import ConfigError
from service.core.persist.store import StateChanges, TokenAppend
from service.state.postgres import _UNCOUNTED, COUNT_EVERY_COMMITS, SCHEMA_VERSION, PostgresState

from .test_commit_retries import _decoding, _params
from .test_state_postgres import Replica, replicas  # noqa: F401 - the fixture


def _row_version(database_url: str, seq_id: int) -> str:
    """The sequence row's xmin: it changes whenever the row is written."""
    with psycopg.connect(database_url) as conn:
        return conn.execute(
            "SELECT xmin::text FROM sequences WHERE seq_id = %s", (seq_id,)
        ).fetchone()[0]


def test_steady_steps_leave_the_sequence_row_alone_and_get_sequence_stays_exact(
    replicas, database_url
):
    a, b = replicas("a"), replicas("b")
    seq_id = b.submit(max_new_tokens=1000)
    a.state.claim(1)
    a.state.save(_decoding(seq_id, (1, 2, 3)))  # a first append writes the row
    written = _row_version(database_url, seq_id)
    for start in range(3, 3 + 3 * COUNT_EVERY_COMMITS):  # 48 steady steps, one token each
        a.state.save(StateChanges(tokens=(TokenAppend(seq_id, start, (4,)),)))
        assert b.state.sequence_info(seq_id).generated_tokens == start + 1
    assert _row_version(database_url, seq_id) == written
    assert b.state.read_output(seq_id, 0).token_ids == (1, 2, 3) + (4,) * 48


def test_get_sequence_reads_only_the_log_rows_after_its_replicas_counts_row(replicas, database_url):
    a, b = replicas("a"), replicas("b")
    seq_id, other = b.submit(max_new_tokens=1000), b.submit(max_new_tokens=1000)
    a.state.claim(2)
    a.state.save(_decoding(seq_id, (1,)))
    a.state.save(_decoding(other, (1,)))
    for start in range(1, 1 + 2 * COUNT_EVERY_COMMITS + 5):
        a.state.save(
            StateChanges(tokens=(TokenAppend(seq_id, start, (2,)), TokenAppend(other, start, (3,))))
        )
    with psycopg.connect(database_url, autocommit=True) as conn:
        [(through,)] = conn.execute(
            "SELECT through_log FROM replica_counts WHERE replica_id = %s", (a.state.replica_id,)
        ).fetchall()
        uncounted = conn.execute(
            f"SELECT cardinality({_UNCOUNTED}) FROM sequences s WHERE seq_id = %s", (seq_id,)
        ).fetchone()[0]
        assert 0 < uncounted < COUNT_EVERY_COMMITS
        # The rows the counts row covers are not read: without them the answer is the same.
        conn.execute("DELETE FROM token_log WHERE id <= %s", (through,))
    assert b.state.sequence_info(seq_id).generated_tokens == 2 * COUNT_EVERY_COMMITS + 6
    assert b.state.sequence_info(other).generated_tokens == 2 * COUNT_EVERY_COMMITS + 6


def test_a_sequence_taken_over_is_counted_by_its_new_owner_not_the_old_counts_row(
    replicas, database_url
):
    a, b, c = replicas("a"), replicas("b"), replicas("c")
    seq_id = b.submit(max_new_tokens=1000)
    a.state.claim(1)
    a.state.save(_decoding(seq_id, (1,)))
    for start in range(1, 1 + COUNT_EVERY_COMMITS):  # a's counts row lists it at 17
        a.state.save(StateChanges(tokens=(TokenAppend(seq_id, start, (2,)),)))
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("UPDATE sequences SET worker_id = 'w', state = 3 WHERE seq_id = %s", (seq_id,))
    [taken] = c.state.adopt_worker("w").sequences
    assert len(taken.output_token_ids) == 1 + COUNT_EVERY_COMMITS
    c.state.save(_decoding(seq_id, (5,), start=1 + COUNT_EVERY_COMMITS))
    c.state.save(StateChanges(tokens=(TokenAppend(seq_id, 2 + COUNT_EVERY_COMMITS, (6,)),)))
    assert b.state.sequence_info(seq_id).generated_tokens == 3 + COUNT_EVERY_COMMITS
    assert b.state.read_output(seq_id, COUNT_EVERY_COMMITS).token_ids == (2, 5, 6)


def _to_version_4(database_url: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DROP TABLE replica_counts")
        conn.execute("UPDATE lattice_meta SET value = 4 WHERE key = 'schema_version'")


def test_a_version_4_database_migrates_to_version_5(database_url):
    first = PostgresState(database_url, name="a")
    seq_id = first.submit(_params(), 1000, 0).seq_id
    first.leave()
    first.close()
    _to_version_4(database_url)
    migrated = PostgresState(database_url, name="b")
    try:
        assert migrated.sequence_info(seq_id).generated_tokens == 0
        with psycopg.connect(database_url) as conn:
            assert conn.execute(
                "SELECT value FROM lattice_meta WHERE key = 'schema_version'"
            ).fetchone() == (SCHEMA_VERSION,)
            assert conn.execute("SELECT to_regclass('replica_counts') IS NOT NULL").fetchone() == (
                True,
            )
    finally:
        migrated.close()


def refused_while_a_replica_runs(database_url: str, version: int, downgrade) -> None:
    """With a replica running, `downgrade(database_url)` leaves the database at `version`:
    a new replica refuses to start (one line: stop every version-`version` replica), and
    starts, migrating it, once that replica's lease is gone."""
    old = PostgresState(database_url, name="a")
    downgrade(database_url)
    try:
        with pytest.raises(ConfigError, match=f"stop every version-{version} replica"):
            PostgresState(database_url, name="b")
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("DELETE FROM replicas")  # its lease is over
        old.close()
    PostgresState(database_url, name="b").close()


def test_a_version_4_database_is_not_migrated_while_a_version_4_replica_runs(database_url):
    refused_while_a_replica_runs(database_url, 4, _to_version_4)


def _to_version_5(database_url: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("UPDATE lattice_meta SET value = 5 WHERE key = 'schema_version'")


def test_a_version_5_database_waits_for_its_replicas_to_stop_then_is_migrated(
    database_url,
):
    # A version-5 replica waits for NOTIFYs that version 6 no longer sends, and would put
    # its notifying functions back on start: the two never run together.
    refused_while_a_replica_runs(database_url, 5, _to_version_5)
    with psycopg.connect(database_url) as conn:
        assert conn.execute(
            "SELECT value FROM lattice_meta WHERE key = 'schema_version'"
        ).fetchone() == (SCHEMA_VERSION,)
        assert conn.execute("SELECT to_regclass('sequences_adapter_queued')").fetchone() != (None,)


def test_a_version_6_database_becomes_version_7_beside_a_running_replica(database_url):
    """Version 7 adds an index and the queue's kept size, which a version-6 replica works
    beside: the first version-7 replica migrates while version-6 ones run, counts the
    queue they filled, and they go on committing."""
    running = PostgresState(database_url, name="a")
    seq_id = running.submit(_params(), 1000, 0).seq_id
    with psycopg.connect(database_url, autocommit=True) as conn:  # as version 6 left it
        for trigger in ("sequences_queued_in", "sequences_queued_moved", "sequences_queued_out"):
            conn.execute(f"DROP TRIGGER {trigger} ON sequences")
        conn.execute("DROP TABLE queue_counts")
        conn.execute("DROP FUNCTION lattice_count_queued()")
        conn.execute("DROP INDEX sequences_adapter_queued")
        conn.execute("UPDATE lattice_meta SET value = 6 WHERE key = 'schema_version'")
        # A sequence a version-6 replica queues meanwhile.
        conn.execute(
            "INSERT INTO sequences (seq_id, params, prompt, priority, tenant, max_new_tokens, "
            "submitted_at, state, queue_key) VALUES (nextval('lattice_seq_ids'), '{}', "
            "'\\x01000000', 0, 't', 8, 0, 1, nextval('lattice_queue_tail'))"
        )
    started = PostgresState(database_url, name="b")
    try:
        with psycopg.connect(database_url) as conn:
            assert conn.execute(
                "SELECT value FROM lattice_meta WHERE key = 'schema_version'"
            ).fetchone() == (7,)
            assert conn.execute("SELECT to_regclass('sequences_adapter_queued')").fetchone() != (
                None,
            )
        assert started.queue_depth() == 2
        assert running.claim(1).sequences[0].seq_id == seq_id
        running.save(_decoding(seq_id, (1, 2)))
        assert started.sequence_info(seq_id).generated_tokens == 2
        assert started.queue_depth() == 1
    finally:
        started.close()
        running.close()


def test_a_replica_starts_beside_running_commits_without_waiting_for_their_tables(database_url):
    """A replica starting on a database of the current schema takes no lock on the tables
    commits write: its table DDL (ALTER TABLE, CREATE INDEX) runs only where the schema is
    created or migrated, so a start neither stalls the fleet's commits nor waits on them."""
    first = PostgresState(database_url, name="a")
    started: list[PostgresState] = []
    with psycopg.connect(database_url) as conn:
        # What a commit in flight holds on the tables it writes.
        conn.execute("LOCK TABLE token_log, sequences, replica_counts IN ROW EXCLUSIVE MODE")
        starting = threading.Thread(
            target=lambda: started.append(PostgresState(database_url, name="b")), daemon=True
        )
        starting.start()
        starting.join(timeout=30)
        assert started, "the second replica's start waited for the commit in flight"
    starting.join()
    for state in (first, *started):
        state.close()
