"""What a replica's commits keep under retries, races and long lives (schema 4): a retried
commit applies nothing twice, a claim made while the slow path re-reads ownership is not
lost, GetSequence counts from the sequence row and the few log rows it does not count
yet, and the token log stays bounded while a sequence lives long. Against a real
private cluster."""

from __future__ import annotations

from contextlib import contextmanager

import psycopg
import pytest

from service.core.persist.store import SequenceProgress, StateChanges, StoreError, TokenAppend
from service.core.types import FinishReason, SequenceState
from service.state.postgres import _UNCOUNTED, COUNT_EVERY_TOKENS, SCHEMA_VERSION, PostgresState

from .test_state_postgres import Replica, replicas  # noqa: F401 - the fixture


def _progress(seq_id: int, generated: int = 0) -> SequenceProgress:
    return SequenceProgress(seq_id, SequenceState.DECODING, "w", None, 0, 0, generated, 0, None)


def _finished(seq_id: int, generated: int) -> SequenceProgress:
    return SequenceProgress(
        seq_id, SequenceState.FINISHED, "w", None, 0, 0, generated, 0, FinishReason.STOP
    )


def _decoding(seq_id: int, token_ids: tuple[int, ...], start: int = 0) -> StateChanges:
    return StateChanges(
        progress=(_progress(seq_id, start + len(token_ids)),),
        tokens=(TokenAppend(seq_id, start, token_ids),),
    )


class _Rows(list):
    """A statement's rows, read before a hook ran, as its cursor would give them."""

    def fetchall(self) -> list:
        return list(self)

    def fetchone(self):
        return self[0] if self else None


class _Connection:
    """A pooled connection that can fail as a lost connection does after the server
    committed, and run a hook right after one statement's rows are read (`after_read`:
    (text of the statement, hook), or a list of them met in that order)."""

    def __init__(self, conn, faults: dict) -> None:
        self._conn = conn
        self._faults = faults
        self._in_pipeline = False
        self._in_transaction = False

    def __getattr__(self, name):
        return getattr(self._conn, name)

    def _lose_reply(self) -> None:
        if self._faults.pop("lose_reply", False):
            raise psycopg.OperationalError("server closed the connection unexpectedly")

    @contextmanager
    def pipeline(self):
        self._faults["pipelines"] = self._faults.get("pipelines", 0) + 1
        if self._faults.get("refuse_pipeline") == self._faults["pipelines"]:
            raise psycopg.OperationalError("connection refused")  # nothing sent
        self._in_pipeline = True
        try:
            with self._conn.pipeline() as pipeline:
                yield pipeline
        finally:
            self._in_pipeline = False
        self._lose_reply()  # the pipeline's sync carried COMMIT: committed, reply lost

    @contextmanager
    def transaction(self):
        self._faults["transactions"] = self._faults.get("transactions", 0) + 1
        self._in_transaction = True
        try:
            with self._conn.transaction() as transaction:
                yield transaction
        finally:
            self._in_transaction = False
        if not self._in_pipeline:
            self._lose_reply()

    def execute(self, query, *args, **kwargs):
        self._faults.setdefault("queries", []).append(query)
        cursor = self._conn.execute(query, *args, **kwargs)
        if not (self._in_pipeline or self._in_transaction):
            self._lose_reply()  # a statement on its own (autocommit) committed
        hooks = self._faults.get("after_read")
        if hooks is None:
            return cursor
        hooks = [hooks] if isinstance(hooks, tuple) else hooks
        text, hook = hooks[0]
        if text not in query:
            return cursor
        if hooks[1:]:
            self._faults["after_read"] = hooks[1:]
        else:
            del self._faults["after_read"]
        rows = _Rows(cursor.fetchall())
        hook()
        return rows


@pytest.fixture
def faulty():
    """`faulty(store)` -> the dict of faults its connections obey from now on."""

    def install(store: PostgresState) -> dict:
        faults: dict = {}
        real = store._connection

        @contextmanager
        def connection():
            with real() as conn:
                yield _Connection(conn, faults)

        store._connection = connection
        return faults

    return install


@pytest.mark.parametrize("path", ["fast", "slow"])
def test_a_retried_commit_that_had_committed_adds_tenant_service_and_tokens_once(
    replicas, database_url, faulty, path
):
    a, b = replicas("a"), replicas("b")
    seq_id = b.submit(max_new_tokens=8)
    a.state.claim(1)
    a.state.defer_saves()
    if path == "fast":  # a first commit sees the fence: the next one takes the fast path
        a.state.save(StateChanges(progress=(_progress(seq_id),)))
        a.state.commit_pending()
    faults = faulty(a.state)
    a.state.save(_decoding(seq_id, (7, 8)))
    a.state.save(StateChanges(tenant_service=(("t", 5.0),)))
    faults["lose_reply"] = True
    with pytest.raises(StoreError):
        a.state.commit_pending()  # committed, but this replica cannot know it
    a.state.save(StateChanges(tenant_service=(("t", 6.0),)))
    a.state.commit_pending()  # the retry, then the later save
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT served FROM tenant_service").fetchall() == [(6.0,)]
        assert conn.execute("SELECT count(*) FROM token_log").fetchone() == (1,)
    assert b.state.read_output(seq_id, 0).token_ids == (7, 8)
    assert a.state.num_saves_committed == a.state.num_saves


@pytest.mark.parametrize("renewed", [False, True])
@pytest.mark.parametrize("lost", ["reply", "request"])
def test_a_commit_retried_after_its_lease_ran_out_adds_tenant_service_once(
    replicas, database_url, faulty, renewed, lost
):
    a, b = replicas("a"), replicas("b")
    seq_id = b.submit(max_new_tokens=8)
    a.state.claim(1)
    a.state.defer_saves()
    a.state.save(StateChanges(progress=(_progress(seq_id),)))
    a.state.commit_pending()  # the fence is known: the next commit takes the fast path
    faults = faulty(a.state)
    a.state.save(_decoding(seq_id, (7, 8)))
    a.state.save(StateChanges(tenant_service=(("t", 5.0),)))
    if lost == "reply":  # committed, but this replica cannot know it
        faults["lose_reply"] = True
    else:  # nothing reached the server
        faults["refuse_pipeline"] = 1
    with pytest.raises(StoreError):
        a.state.commit_pending()
    with psycopg.connect(database_url, autocommit=True) as conn:  # a's lease runs out
        conn.execute(
            "UPDATE replicas SET lease_until = now() - interval '1 second' WHERE replica_id = %s",
            (a.state.replica_id,),
        )
    b.state.reclaim_expired()  # deletes a's row, returns its sequence
    if not renewed and lost == "reply":  # retried while the row is gone: the kept number
        a.state.commit_pending()  # says it committed, settled
    elif not renewed:  # retried while the row is gone: nothing commits
        with pytest.raises(StoreError, match="no row"):
            a.state.commit_pending()
    assert not a.state.renew_lease()  # a writes its row again
    a.state.save(StateChanges(tenant_service=(("t", 6.0),)))
    a.state.commit_pending()  # the retry (applies what had not committed), the later save
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT served FROM tenant_service").fetchall() == [(6.0,)]
    # The sequence went back to the shared queue with the tokens committed before.
    assert b.state.read_output(seq_id, 0).token_ids == ((7, 8) if lost == "reply" else ())


def _gone(replicas, database_url):
    """Replica a owning a sequence b submitted, its fence known, then its lease run out
    and its row deleted by b's keeper: (a, b, seq_id)."""
    a, b = replicas("a"), replicas("b")
    seq_id = b.submit(max_new_tokens=8)
    a.state.claim(1)
    a.state.defer_saves()
    a.state.save(_decoding(seq_id, (5,)))
    a.state.commit_pending()  # commit 1, recorded on the row, kept in lattice_meta
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE replicas SET lease_until = now() - interval '1 second' WHERE replica_id = %s",
            (a.state.replica_id,),
        )
    b.state.reclaim_expired()
    return a, b, seq_id


@pytest.mark.parametrize("touching", [False, True])
def test_a_commit_attempted_while_the_row_is_gone_adds_tenant_service_once(
    replicas, database_url, faulty, touching
):
    a, b, seq_id = _gone(replicas, database_url)
    faults = faulty(a.state)
    if touching:  # also a step of the sequence b's keeper took back: the slow path
        a.state.save(StateChanges(tokens=(TokenAppend(seq_id, 1, (6,)),)))
    a.state.save(StateChanges(tenant_service=(("t", 5.0),)))
    faults["lose_reply"] = True  # were it to commit, its reply would be lost
    with pytest.raises(StoreError):
        a.state.commit_pending()
    faults.pop("lose_reply", None)  # a refused attempt had no commit reply to lose
    with pytest.raises(StoreError, match="no row"):
        a.state.commit_pending()  # retried before the row is written again
    assert not a.state.renew_lease()
    assert a.state.commit_pending() == ({seq_id} if touching else frozenset())
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT served FROM tenant_service").fetchall() == [(5.0,)]
    assert b.state.read_output(seq_id, 0).token_ids == (5,)


def test_a_steady_commit_while_the_row_is_gone_commits_nothing(replicas, database_url):
    a, b, seq_id = _gone(replicas, database_url)
    a.state.save(StateChanges(tokens=(TokenAppend(seq_id, 1, (6,)),)))  # lattice_append
    with pytest.raises(StoreError, match="no row"):
        a.state.commit_pending()
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT count(*) FROM token_log").fetchone() == (1,)
    assert not a.state.renew_lease()
    assert a.state.commit_pending() == {seq_id}  # retried: b's keeper took it back
    assert b.state.read_output(seq_id, 0).token_ids == (5,)


def test_a_replica_that_leaves_takes_its_kept_commit_number_with_it(replicas, database_url):
    a, _, _ = _gone(replicas, database_url)
    key = f"last_commit:{a.state.replica_id}"
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT value FROM lattice_meta WHERE key = %s", (key,)).fetchone()
    a.state.leave()
    with psycopg.connect(database_url) as conn:
        assert not conn.execute("SELECT 1 FROM lattice_meta WHERE key = %s", (key,)).fetchone()


def test_sequences_a_retry_left_out_are_reported_even_when_the_next_commit_fails(
    replicas, database_url, faulty
):
    a, b = replicas("a"), replicas("b")
    first, second = b.submit(max_new_tokens=8), b.submit(max_new_tokens=8)
    a.state.claim(2)
    a.state.defer_saves()
    a.state.save(StateChanges(progress=(_progress(first), _progress(second))))
    a.state.commit_pending()  # the fence is known: commits take the fast path
    faults = faulty(a.state)
    a.state.save(StateChanges(progress=(_progress(first, 1),)))
    faults["refuse_pipeline"] = 1
    with pytest.raises(StoreError):
        a.state.commit_pending()
    with psycopg.connect(database_url, autocommit=True) as conn:  # b takes `first`
        conn.execute(
            "UPDATE sequences SET owner = %s WHERE seq_id = %s", (b.state.replica_id, first)
        )
        conn.execute(
            "UPDATE replicas SET fence = nextval('lattice_fences') WHERE replica_id = %s",
            (a.state.replica_id,),
        )
    a.state.save(StateChanges(progress=(_progress(second, 1),)))
    # The retry meets the moved fence (pipeline 2), commits without `first` on the slow
    # path; the newer batch's pipeline (3) is refused.
    faults["refuse_pipeline"] = 3
    with pytest.raises(StoreError):
        a.state.commit_pending()
    assert a.state.commit_pending() == {first}  # told once the newer batch commits


def test_a_claim_made_while_the_slow_path_reads_ownership_stays_owned(replicas, faulty):
    a, b = replicas("a"), replicas("b")
    first, second = b.submit(max_new_tokens=8), b.submit(max_new_tokens=8)
    assert [s.seq_id for s in a.state.claim(1).sequences] == [first]
    a.state.defer_saves()
    faults = faulty(a.state)
    # The first commit has no fence yet: the slow path reads what the replica owns, and
    # right then (on another connection, as the prefetcher does) the replica claims more.
    faults["after_read"] = (
        "WHERE owner = %s AND state <> 4",
        lambda: a.state.claim(1),
    )
    a.state.save(StateChanges(progress=(_progress(first),)))
    a.state.commit_pending()
    assert "after_read" not in faults  # the claim did run inside the read
    before = a.state.round_trips["save"]
    a.state.save(StateChanges(progress=(_progress(second),)))
    a.state.commit_pending()
    assert a.state.round_trips["save"] - before == 1  # the fast path: `second` is known owned


def test_get_sequence_counts_from_the_row_and_only_the_log_rows_it_does_not_count_yet(
    replicas, database_url
):
    a, b = replicas("a"), replicas("b")
    seq_id = b.submit(max_new_tokens=8)
    a.state.claim(1)
    a.state.save(_decoding(seq_id, (7, 8, 9)))  # a first append writes the count: 3
    for start in (3, 4):  # steady steps: appends only, the row's count lags
        a.state.save(StateChanges(tokens=(TokenAppend(seq_id, start, (10,)),)))
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert conn.execute(
            "SELECT num_saved FROM sequences WHERE seq_id = %s", (seq_id,)
        ).fetchone() == (3,)
        # The rows the count covers are not read: without them the answer is the same.
        conn.execute("DELETE FROM token_log WHERE id = (SELECT min(id) FROM token_log)")
    assert b.state.sequence_info(seq_id).generated_tokens == 5
    for start in range(5, 5 + COUNT_EVERY_TOKENS):  # a lag this long writes the count
        a.state.save(StateChanges(tokens=(TokenAppend(seq_id, start, (11,)),)))
    with psycopg.connect(database_url) as conn:
        assert conn.execute(
            "SELECT num_saved FROM sequences WHERE seq_id = %s", (seq_id,)
        ).fetchone() == (3 + COUNT_EVERY_TOKENS,)  # written once it lagged that much
    assert b.state.sequence_info(seq_id).generated_tokens == 5 + COUNT_EVERY_TOKENS


def test_a_long_lived_sequence_does_not_hold_back_token_log_collection(replicas, database_url):
    a, b = replicas("a"), replicas("b")
    long_lived = b.submit(max_new_tokens=1000)
    others = [b.submit(max_new_tokens=2) for _ in range(4)]
    a.state.claim(5)
    a.state.save(_decoding(long_lived, (1, 2)))
    for seq_id in others:  # rows written after it started, of sequences that go
        a.state.save(_decoding(seq_id, (5,)))
        a.state.save(StateChanges(forgotten=(seq_id,)))
    a.state.save(_decoding(long_lived, (3,), start=2))
    a.state.max_log_rows_behind = 1
    assert b.state.read_output(long_lived, 1).token_ids == (2, 3)  # a stream's place
    # Its tokens go into its head; then no sequence points at any of the 6 rows.
    assert a.state.collect_token_log() == 6
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT count(*) FROM token_log").fetchone() == (0,)
    assert b.state.read_output(long_lived, 0).token_ids == (1, 2, 3)
    assert b.state.read_output(long_lived, 1).token_ids == (2, 3)
    a.state.save(_decoding(long_lived, (4,), start=3))
    assert b.state.read_output(long_lived, 3).token_ids == (4,)
    assert b.state.sequence_info(long_lived).generated_tokens == 4
    # Another replica taking it over reads the folded head and the rest.
    c = replicas("c")
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE sequences SET worker_id = 'w', state = 3 WHERE seq_id = %s", (long_lived,)
        )
    [taken] = c.state.adopt_worker("w").sequences
    assert taken.output_token_ids == [1, 2, 3, 4]
    c.state.save(_decoding(long_lived, (5,), start=4))
    assert b.state.read_output(long_lived, 0).token_ids == (1, 2, 3, 4, 5)


def test_a_fold_with_no_new_tokens_rewrites_no_finished_row(replicas, database_url):
    a, b = replicas("a"), replicas("b")
    done = [b.submit(max_new_tokens=8) for _ in range(3)]
    busy = b.submit(max_new_tokens=1000)
    a.state.claim(4)
    for seq_id in done:
        a.state.save(_decoding(seq_id, (1, 2)))
        a.state.save(StateChanges(progress=(_finished(seq_id, 2),)))
    a.state.save(_decoding(busy, (5, 5)))
    a.state.save(StateChanges(tokens=(TokenAppend(busy, 2, (5,)),)))
    a.state.max_log_rows_behind = 1

    def versions() -> dict[int, str]:  # a row's xmin changes when it is rewritten
        with psycopg.connect(database_url) as conn:
            return dict(
                conn.execute(
                    "SELECT seq_id, xmin::text FROM sequences WHERE seq_id = ANY(%s)", (done,)
                ).fetchall()
            )

    a.state.collect_token_log()  # folds them once
    before = versions()
    for start in range(3, 7):  # another sequence's steps: the finished ones fall behind
        a.state.save(StateChanges(tokens=(TokenAppend(busy, start, (5,)),)))
        a.state.collect_token_log()
    assert versions() == before
    for seq_id in done:
        assert b.state.read_output(seq_id, 0).token_ids == (1, 2)
        assert b.state.sequence_info(seq_id).generated_tokens == 2
    assert b.state.read_output(busy, 0).token_ids == (5,) * 7


def test_get_sequence_of_a_finished_sequence_reads_no_log_row(replicas, database_url):
    a, b = replicas("a"), replicas("b")
    done, busy = b.submit(max_new_tokens=8), b.submit(max_new_tokens=1000)
    a.state.claim(2)
    a.state.save(_decoding(done, (1, 2)))
    a.state.save(StateChanges(tokens=(TokenAppend(done, 2, (3,)),)))  # the count lags
    a.state.save(StateChanges(progress=(_finished(done, 3),)))  # a stop: no append
    a.state.save(_decoding(busy, (9,)))
    for start in range(1, 201):  # another sequence's steady steps on the same replica
        a.state.save(StateChanges(tokens=(TokenAppend(busy, start, (9,)),)))
    with psycopg.connect(database_url) as conn:
        assert conn.execute(
            f"SELECT num_saved, cardinality({_UNCOUNTED}) FROM sequences s WHERE seq_id = %s",
            (done,),
        ).fetchone() == (3, 0)
    assert b.state.sequence_info(done).generated_tokens == 3
    assert b.state.read_output(done, 0).token_ids == (1, 2, 3)


def test_a_sequence_cancelled_when_its_replica_died_counts_every_saved_token(
    replicas, database_url
):
    a, b = replicas("a"), replicas("b")
    seq_id = b.submit(max_new_tokens=8)
    a.state.claim(1)
    a.state.save(_decoding(seq_id, (1, 2)))
    a.state.save(StateChanges(tokens=(TokenAppend(seq_id, 2, (3,)),)))  # the count lags
    assert b.state.cancel(seq_id)  # requested of its owner, a
    with psycopg.connect(database_url, autocommit=True) as conn:  # a's lease runs out
        conn.execute(
            "UPDATE replicas SET lease_until = now() - interval '1 second' WHERE replica_id = %s",
            (a.state.replica_id,),
        )
    assert b.state.reclaim_expired() == 1
    info = b.state.sequence_info(seq_id)
    assert (info.state, info.generated_tokens) == (SequenceState.FINISHED, 3)


def test_a_fold_locks_an_owner_whose_commit_landed_while_it_locked_the_others(
    replicas, database_url, faulty
):
    a, b, c = replicas("a"), replicas("b"), replicas("c")
    mine, theirs = b.submit(max_new_tokens=8), b.submit(max_new_tokens=8)
    a.state.claim(1)
    c.state.claim(1)
    a.state.save(_decoding(mine, (1,)))
    c.state.save(_decoding(theirs, (2,)))
    for start in (1, 2):
        a.state.save(StateChanges(tokens=(TokenAppend(mine, start, (1,)),)))
    a.state.max_log_rows_behind = 1
    with psycopg.connect(database_url, autocommit=True) as conn:
        # c's commit of `theirs` is under way: not visible when the keeper reads owners.
        log_from = conn.execute(
            "SELECT log_from FROM sequences WHERE seq_id = %s", (theirs,)
        ).fetchone()[0]
        conn.execute("UPDATE sequences SET log_from = NULL WHERE seq_id = %s", (theirs,))
    held: list[bool] = []

    def commit_lands() -> None:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("UPDATE sequences SET log_from = %s WHERE seq_id = %s", (log_from, theirs))

    def c_row_held() -> None:
        with psycopg.connect(database_url, autocommit=True) as conn:
            try:
                conn.execute(
                    "SELECT 1 FROM replicas WHERE replica_id = %s FOR UPDATE NOWAIT",
                    (c.state.replica_id,),
                )
                held.append(False)
            except psycopg.errors.LockNotAvailable:
                held.append(True)

    faults = faulty(a.state)
    faults["after_read"] = [
        ("SELECT 1 FROM replicas WHERE replica_id", commit_lands),
        ("ORDER BY seq_id FOR UPDATE", c_row_held),
    ]
    a.state.collect_token_log()
    assert "after_read" not in faults  # both ran inside the fold
    assert held == [True]  # c's commits wait while its rows are folded
    assert b.state.read_output(theirs, 0).token_ids == (2,)


def _to_version_3(database_url: str, seq_id: int, rows: list[bytes]) -> None:
    """Turn a fresh database into schema 3's shape, with token log rows as it wrote them."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DROP TABLE token_log")
        conn.execute(
            "CREATE TABLE token_log (id bigserial PRIMARY KEY, seq_ids bigint[] NOT NULL, "
            "max_seq_id bigint NOT NULL, entries bytea NOT NULL)"
        )
        conn.execute("CREATE INDEX token_log_seq_ids ON token_log USING gin (seq_ids)")
        for blob in rows:
            conn.execute(
                "INSERT INTO token_log (seq_ids, max_seq_id, entries) VALUES (%s, %s, %s)",
                ([seq_id], seq_id, blob),
            )
        for column in ("num_saved", "output_head", "log_replica", "log_from"):
            conn.execute(f"ALTER TABLE sequences DROP COLUMN {column}")
        conn.execute("ALTER TABLE replicas DROP COLUMN last_commit")
        conn.execute("UPDATE lattice_meta SET value = 3 WHERE key = 'schema_version'")


def test_a_version_3_database_migrates_its_token_log_into_sequence_heads(database_url):
    from service.state.token_log import pack_entries

    first = PostgresState(database_url, name="a")
    seq_id = first.submit(_params(), 1000, 0).seq_id
    first.leave()
    first.close()
    _to_version_3(
        database_url,
        seq_id,
        [
            pack_entries([TokenAppend(seq_id, 0, (7, 8))]),
            pack_entries([TokenAppend(seq_id, 2, (9,))]),
        ],
    )
    migrated = PostgresState(database_url, name="b")
    try:
        assert migrated.read_output(seq_id, 0).token_ids == (7, 8, 9)
        assert migrated.sequence_info(seq_id).generated_tokens == 3
        with psycopg.connect(database_url) as conn:
            assert conn.execute(
                "SELECT value FROM lattice_meta WHERE key = 'schema_version'"
            ).fetchone() == (SCHEMA_VERSION,)
            assert conn.execute("SELECT count(*) FROM token_log").fetchone() == (0,)
            assert conn.execute(
                "SELECT count(*) FROM pg_indexes WHERE indexname = 'token_log_seq_ids'"
            ).fetchone() == (0,)
    finally:
        migrated.close()


def test_a_version_3_database_is_not_migrated_while_a_version_3_replica_runs(database_url):
    from .test_replica_counts import refused_while_a_replica_runs

    refused_while_a_replica_runs(database_url, 3, lambda url: _to_version_3(url, 0, []))


def _params():
    from tests.unit.factories import params

    return params(max_new_tokens=8)


def _steady(replicas, faulty):
    """Replica a decoding a sequence b submitted, its fence known (commits take the fast
    path): (a, b, seq_id, the faults of a's connections)."""
    a, b = replicas("a"), replicas("b")
    seq_id = b.submit(max_new_tokens=64)
    a.state.claim(1)
    a.state.defer_saves()
    a.state.save(_decoding(seq_id, (5,)))
    a.state.commit_pending()
    return a, b, seq_id, faulty(a.state)


def test_a_steady_commit_is_one_statement_without_begin_or_commit(replicas, faulty):
    a, b, seq_id, faults = _steady(replicas, faulty)
    for n in range(1, 4):  # appends only, as a decode step saves them
        a.state.save(StateChanges(tokens=(TokenAppend(seq_id, n, (5 + n,)),)))
        a.state.commit_pending()
    assert len(faults["queries"]) == 3
    assert "pipelines" not in faults and "transactions" not in faults
    assert b.state.read_output(seq_id, 0).token_ids == (5, 6, 7, 8)


def test_a_retried_steady_commit_that_had_committed_appends_once(replicas, database_url, faulty):
    a, b, seq_id, faults = _steady(replicas, faulty)
    a.state.save(StateChanges(tokens=(TokenAppend(seq_id, 1, (6, 7)),)))
    faults["lose_reply"] = True
    with pytest.raises(StoreError):
        a.state.commit_pending()  # committed, but this replica cannot know it
    a.state.save(StateChanges(tokens=(TokenAppend(seq_id, 3, (8,)),)))
    a.state.commit_pending()  # the retry (applies nothing), then the later save
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT count(*) FROM token_log").fetchone() == (3,)
    assert b.state.read_output(seq_id, 0).token_ids == (5, 6, 7, 8)
    assert a.state.num_saves_committed == a.state.num_saves


def test_a_steady_commit_after_a_take_over_leaves_the_taken_sequence_out(
    replicas, database_url, faulty
):
    a, b, seq_id, _ = _steady(replicas, faulty)
    kept = b.submit(max_new_tokens=64)
    a.state.claim(1)
    with psycopg.connect(database_url, autocommit=True) as conn:  # b takes `seq_id`
        conn.execute(
            "UPDATE sequences SET owner = %s WHERE seq_id = %s", (b.state.replica_id, seq_id)
        )
        conn.execute(
            "UPDATE replicas SET fence = nextval('lattice_fences') WHERE replica_id = %s",
            (a.state.replica_id,),
        )
    a.state.save(StateChanges(tokens=(TokenAppend(seq_id, 1, (6,)), TokenAppend(kept, 0, (9,)))))
    assert a.state.commit_pending() == {seq_id}  # the fence moved: checked row by row
    assert b.state.read_output(seq_id, 0).token_ids == (5,)
    assert b.state.read_output(kept, 0).token_ids == (9,)


def test_commits_send_no_notification_and_the_commit_number_moves(replicas, faulty):
    a, b, seq_id, faults = _steady(replicas, faulty)
    listener = b.state.listen_connection()
    before = b.state.watch(listener).marks[a.state.replica_id]
    for n in range(1, 4):  # appends only, as a decode step saves them
        a.state.save(StateChanges(tokens=(TokenAppend(seq_id, n, (5 + n,)),)))
        a.state.commit_pending()
    assert len(faults["queries"]) == 3  # the one-statement path
    assert [n.channel for n in listener.notifies(timeout=0.5)] == []
    assert b.state.watch(listener).marks[a.state.replica_id] == before + 3
    assert a.state.replica_id not in a.state.watch(listener).marks  # only the others'
    # A commit that changes a sequence's state (the transaction path) notifies no one
    # either, and moves the number too.
    a.state.save(_decoding(seq_id, (9,), start=4))
    a.state.commit_pending()
    assert b.state.watch(listener).marks[a.state.replica_id] == before + 4
    assert [n.channel for n in listener.notifies(timeout=0.5)] == []
    listener.close()
