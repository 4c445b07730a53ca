#!/usr/bin/env python3
"""What one group commit costs PostgreSQL, part by part: server CPU (postmaster and its
backends, from /proc) and wall time per commit, for commits of growing content, on one
private cluster with fsync on and `synchronous_commit = off` (as worker progress is
committed under --state-fsync acks).

  empty             BEGIN; COMMIT (one pipeline, one round trip)
  number            + the commit number and fence (one row update: _RECORD_COMMIT)
  number+notify     + one NOTIFY carrying --sequences ids
  progress          a replica's real commit (PostgresState.commit_pending): the number,
                    the progress of --sequences sequences, the NOTIFY
  progress+tokens   the same with one token appended to each (every row written)
  tokens            one token appended to each sequence and no progress: the steady
                    decode step as the core saves it (the replica's counts row written
                    by one commit in COUNT_EVERY_COMMITS, a sequence's row once in
                    COUNT_EVERY_TOKENS appends), as separate statements in a pipeline
                    between BEGIN and COMMIT
  tokens-1stmt      the same as the store commits it: one lattice_append call in
                    autocommit (no NOTIFY: a steady commit notifies no one)
  submit            not a group commit: one Submit (lattice_enqueue, its own synchronous
                    commit), which notified every listener until stop 41
  submit-group      --group N Submits in one transaction with one synchronous commit, as
                    a group commit of concurrent Submits on one replica would make them:
                    N lattice_enqueue calls in a pipeline between BEGIN and COMMIT (one
                    round trip); a value PostgreSQL refuses would abort all N
  submit-group+sp   the same with each call between SAVEPOINT and RELEASE (pipelined: the
                    subtransactions' cost, though one refused call still skips the rest of
                    a pipeline)
  submit-group+guard  the same with each call in a PL/pgSQL exception block (a function
                    the bench creates): a request whose values PostgreSQL refuses answers
                    status 4 and the others commit, still in one round trip
  submit-group+1stmt  the group as one statement in autocommit (lattice_enqueue called
                    for each row of the requests' arrays): no BEGIN and COMMIT exchanges
  watch             not a commit: one reading of what no notification announces
                    (PostgresState.watch, on a connection of its own: the other
                    replicas' commit numbers and the new seq_ids), which a replica
                    makes every --replica-watch-ms
  watch+claims      the same reading while streams wait on --sequences unclaimed
                    sequences: it also looks up which of them have an owner now (here
                    all: the bench's sequences are claimed), as a claim notifies no one

With `--listeners K`, K more connections LISTEN on the replicas' channels meanwhile (as
K replicas' listener threads do, draining their notifications), and their backends' CPU
per commit is shown apart: PostgreSQL wakes every listening backend of the database for
each NOTIFY, whatever its channel.

With `--watch-ms 5,20`, a second table: a thread making that reading at each interval
for `--watch-seconds`, as a replica's watcher does: readings/s, the thread's own CPU
(`time.thread_time`) and PostgreSQL's, per reading and as a share of a core.

The submits (the submit shapes) are also shown per submit, in a table of their own:
PostgreSQL's CPU per submit, and wall time per group (its commit waits for the WAL flush);
`--commits` counts groups. A NUL in a string (the refusal store.submit knows) is refused
by psycopg on the client before anything is sent: it aborts a group in every variant, so
a group must adapt each request's values before it joins.

Divide by the saves a commit holds (bench.replicas: commits per decision) for the cost per
decision.

    .venv/bin/python -m bench.pg_commit_cost --commits 400 --sequences 224
    .venv/bin/python -m bench.pg_commit_cost --commits 400 --sequences 288 --rounds 3 \
        --shapes submit,submit-group,submit-group+sp,submit-group+guard,submit-group+1stmt \
        --group 1,4,8,16
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

from bench.harness.processes import cpu_seconds_single_threaded as cpu_seconds
from bench.harness.tables import print_table
from bench.replicas import database_pids
from common.cli_values import integer
from service.core import SubmitParams
from service.core.persist.store import SequenceProgress, StateChanges, TokenAppend
from service.core.types import SequenceState
from service.state.pg_cluster import PrivateCluster
from service.state.postgres import _RECORD_COMMIT, PostgresState

SHAPES = (
    "empty",
    "number",
    "number+notify",
    "progress",
    "progress+tokens",
    "tokens",
    "tokens-1stmt",
    "submit",
    "submit-group",
    "submit-group+sp",
    "submit-group+guard",
    "submit-group+1stmt",
    "watch",
    "watch+claims",
)
# A submit's own values and limits, as the `submit` shape passes them to PostgresState.submit.
_SUBMIT = SubmitParams(prompt_token_ids=tuple(range(1, 33)), max_new_tokens=16)
_MAX_QUEUE = 10**7

# lattice_enqueue in an exception block (a subtransaction): a request whose values
# PostgreSQL refuses (a data exception: the class store.submit answers InvalidArgument for)
# answers status 4 and leaves the group's other requests to commit.
_GUARDED = """
CREATE OR REPLACE FUNCTION bench_enqueue_guarded(
    p_principal text, p_adapter_id text, p_request_id text, p_params text, p_prompt bytea,
    p_priority integer, p_tenant text, p_max_new_tokens integer, p_max_queue bigint,
    p_max_per_tenant bigint, p_sync boolean, p_prefix_keys bigint[],
    OUT status integer, OUT seq_id bigint, OUT queue_position bigint)
LANGUAGE plpgsql AS $$
BEGIN
    SELECT e.status, e.seq_id, e.queue_position INTO status, seq_id, queue_position
      FROM lattice_enqueue(p_principal, p_adapter_id, p_request_id, p_params, p_prompt,
                           p_priority, p_tenant, p_max_new_tokens, p_max_queue,
                           p_max_per_tenant, p_sync, p_prefix_keys) e;
EXCEPTION WHEN data_exception THEN
    status := 4; seq_id := NULL; queue_position := NULL;
END $$;
"""


def _enqueue_args(store: PostgresState, params: SubmitParams = _SUBMIT) -> tuple:
    """lattice_enqueue's arguments as PostgresState.submit passes them."""
    return store.enqueue_args(params, _MAX_QUEUE, 0)


def submit_group(store: PostgresState, size: int, savepoints: bool = False, guarded: bool = False):
    """`size` Submits in one transaction, one synchronous commit: (status, seq_id,
    position) of each. `savepoints`: each between SAVEPOINT and RELEASE; `guarded`: each
    in an exception block (bench_enqueue_guarded, created by `create_guarded`)."""
    function = "bench_enqueue_guarded" if guarded else "lattice_enqueue"
    statement = (
        f"SELECT status, seq_id, queue_position FROM {function}("
        "%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
    )

    def commit(params: list[SubmitParams] | None = None) -> list[tuple]:
        requests = params if params is not None else [_SUBMIT] * size
        with store._connection() as conn:
            with conn.pipeline(), conn.transaction():
                cursors = []
                for request in requests:
                    if savepoints:
                        conn.execute("SAVEPOINT s")
                    cursors.append(conn.execute(statement, _enqueue_args(store, request)))
                    if savepoints:
                        conn.execute("RELEASE SAVEPOINT s")
            return [cursor.fetchone() for cursor in cursors]

    return commit


# The group as one statement in autocommit (no BEGIN and COMMIT exchanges): lattice_enqueue
# called for each row, in order (each call's reads see the calls before it: the queue's
# count and the request_ids). Prefix keys left out (the bench's store has homes off).
_ENQUEUE_MANY = (
    "SELECT e.status, e.seq_id, e.queue_position FROM unnest(%s::text[], %s::text[], "
    "%s::text[], %s::text[], %s::bytea[], %s::integer[], %s::text[], %s::integer[]) "
    "WITH ORDINALITY AS r(principal, adapter_id, request_id, params, prompt, priority, "
    "tenant, max_new_tokens, n) CROSS JOIN LATERAL lattice_enqueue(r.principal, "
    "r.adapter_id, r.request_id, r.params, r.prompt, r.priority, r.tenant, "
    "r.max_new_tokens, %s, %s, %s, '{}') e ORDER BY r.n"
)


def submit_statement(store: PostgresState, size: int):
    """`size` Submits as one statement (its own transaction, one synchronous commit)."""
    assert not store._affinity_seconds

    def commit(params: list[SubmitParams] | None = None) -> list[tuple]:
        rows = [_enqueue_args(store, request) for request in params or [_SUBMIT] * size]
        columns = [list(column) for column in zip(*(row[:8] for row in rows), strict=True)]
        with store._connection() as conn:
            return conn.execute(_ENQUEUE_MANY, (*columns, *rows[0][8:11])).fetchall()

    return commit


def create_guarded(store: PostgresState) -> None:
    with store._connection() as conn:
        conn.execute(_GUARDED)


_GROUP_SIZE = integer(1, 1000)


def _groups(text: str) -> list[int]:
    """--group's sizes; ValueError(the part refused)."""
    sizes = []
    for part in text.split(","):
        try:
            sizes.append(_GROUP_SIZE(part))
        except argparse.ArgumentTypeError:
            raise ValueError(part) from None
    return sizes


def _raw(store: PostgresState, args, notify: bool, number: bool):
    payload = ",".join(str(i) for i in range(1, args.sequences + 1))

    def commit() -> None:
        with store._connection() as conn, conn.pipeline(), conn.transaction():
            if number:  # numbered as the store's own commits, which come later
                store._last_commit_no += 1
                conn.execute(
                    _RECORD_COMMIT,
                    {"me": store.replica_id, "fence": None, "no": store._last_commit_no},
                )
            if notify:
                conn.execute("SELECT pg_notify('lattice_progress', %s)", (payload,))

    return commit


def _steps(
    store: PostgresState,
    seq_ids: list[int],
    step,
    tokens: bool,
    progress: bool = True,
    one_statement: bool = False,
):
    """`step`: an iterator shared by the shapes, so that each appends where the last ended."""

    def commit() -> None:
        store._steady_in_one_statement = one_statement
        n = next(step)
        store.save(
            StateChanges(
                progress=tuple(
                    SequenceProgress(s, SequenceState.DECODING, "w", None, n, 32, n + 1, 0, None)
                    for s in seq_ids
                )
                if progress
                else (),
                tokens=tuple(TokenAppend(s, n, (n % 1000,)) for s in seq_ids) if tokens else (),
            )
        )
        store.commit_pending()

    return commit


def measure(
    cluster: PrivateCluster, backend: int, commit, count: int, listeners: list[int]
) -> tuple[float, float, float, float]:
    """(PostgreSQL CPU ms, the store's backend's CPU ms, the listeners' backends' CPU ms,
    wall ms) per commit."""
    for _ in range(20):  # warm up
        commit()
    pids = database_pids(cluster)
    cpu0, own0, heard0 = cpu_seconds(pids), cpu_seconds([backend]), cpu_seconds(listeners)
    t0 = time.monotonic()
    for _ in range(count):
        commit()
    wall = time.monotonic() - t0
    time.sleep(0.2)  # the listeners' backends catch up with the last notifications
    cpu, own = cpu_seconds(pids) - cpu0, cpu_seconds([backend]) - own0
    heard = cpu_seconds(listeners) - heard0
    return cpu / count * 1000, own / count * 1000, heard / count * 1000, wall / count * 1000


def watch_cost(
    cluster: PrivateCluster, store: PostgresState, interval: float, seconds: float
) -> tuple[float, float, float]:
    """(readings/s, the reading thread's CPU ms a reading, PostgreSQL's CPU ms a reading)
    of `PostgresState.watch` every `interval` on a connection of its own, as the watcher
    reads."""
    conn = store.watch_connection()
    stop = threading.Event()
    result: list[tuple[int, float]] = []

    def read() -> None:
        count, started = 0, time.thread_time()
        while not stop.is_set():
            store.watch(conn)
            count += 1
            stop.wait(interval)
        result.append((count, time.thread_time() - started))

    pids = database_pids(cluster)
    cpu0, t0 = cpu_seconds(pids), time.monotonic()
    thread = threading.Thread(target=read)
    thread.start()
    time.sleep(seconds)
    stop.set()
    thread.join()
    wall, cpu = time.monotonic() - t0, cpu_seconds(pids) - cpu0
    conn.close()
    count, own = result[0]
    return count / wall, own / count * 1000, cpu / count * 1000


class _Listeners:
    """`count` connections listening on the replicas' channels, each drained by a thread
    of its own (as a replica's listener thread drains its connection)."""

    def __init__(self, store: PostgresState, count: int) -> None:
        self._stop = threading.Event()
        self._conns = [store.listen_connection() for _ in range(count)]
        self.pids = [conn.info.backend_pid for conn in self._conns]
        self._threads = [
            threading.Thread(target=self._drain, args=(conn,), daemon=True) for conn in self._conns
        ]
        for thread in self._threads:
            thread.start()

    def _drain(self, conn) -> None:
        while not self._stop.is_set():
            for _ in conn.notifies(timeout=0.1):
                pass

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        for conn in self._conns:
            conn.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, default=400)
    parser.add_argument("--sequences", type=int, default=224)
    parser.add_argument(
        "--rounds", type=int, default=1, help="time the shapes this many times, alternating"
    )
    parser.add_argument(
        "--shapes",
        default="empty,number,number+notify,progress,progress+tokens,tokens,tokens-1stmt,watch",
        help="which commits to time (comma-separated)",
    )
    parser.add_argument(
        "--listeners",
        type=int,
        default=0,
        help="connections listening on the replicas' channels meanwhile (one a replica)",
    )
    parser.add_argument(
        "--watch-ms",
        default="",
        help="intervals of a commit-number watcher to time (comma-separated ms, each in "
        "(0, 60000); "
        "by default none is timed)",
    )
    parser.add_argument("--watch-seconds", type=float, default=8.0)
    parser.add_argument(
        "--group",
        default="8",
        help="submits a submit-group commit holds (comma-separated sizes: one row each)",
    )
    args = parser.parse_args(argv)
    wanted = args.shapes.split(",")
    unknown = [name for name in wanted if name not in SHAPES]
    if unknown:
        parser.error(f"unknown shape {unknown[0]!r} (known: {', '.join(SHAPES)})")
    try:
        watch_intervals = [float(x) for x in args.watch_ms.split(",") if x]
    except ValueError:
        parser.error(f"--watch-ms must be milliseconds, comma-separated: {args.watch_ms!r}")
    if any(not 0 < ms < 60_000 for ms in watch_intervals):
        parser.error(
            f"--watch-ms must be milliseconds in (0, 60000), comma-separated: {args.watch_ms!r}"
        )
    try:
        groups = _groups(args.group)
    except ValueError as err:
        parser.error(f"--group takes sizes within 1-1000, comma-separated; got {err}")
    if args.commits < 1:
        parser.error(f"--commits must be at least 1, got {args.commits}")
    directory = tempfile.mkdtemp(prefix="lattice-pgcost-")
    cluster = PrivateCluster(directory, fsync=True).start()
    try:
        # One connection, so that its backend's CPU is the commits' alone.
        store = PostgresState(cluster.url, name="cost", pool_size=1)
        seq_ids = [
            store.submit(
                SubmitParams(prompt_token_ids=tuple(range(1, 33)), max_new_tokens=10**6),
                10**6,
                0,
            ).seq_id
            for _ in range(args.sequences)
        ]
        store.claim(args.sequences)
        store.defer_saves()
        with store._connection() as conn:
            backend = conn.info.backend_pid
        listeners = _Listeners(store, args.listeners)
        watch = store.watch_connection()  # the watch shape's, as a replica's watcher has one
        rows = []
        step = iter(range(10**9))
        shapes = [
            ("empty", _raw(store, args, notify=False, number=False)),
            ("number", _raw(store, args, notify=False, number=True)),
            ("number+notify", _raw(store, args, notify=True, number=True)),
            ("progress", _steps(store, seq_ids, step, tokens=False)),
            ("progress+tokens", _steps(store, seq_ids, step, tokens=True)),
            ("tokens", _steps(store, seq_ids, step, tokens=True, progress=False)),
            (
                "tokens-1stmt",
                _steps(store, seq_ids, step, tokens=True, progress=False, one_statement=True),
            ),
            ("submit", lambda: store.submit(_SUBMIT, _MAX_QUEUE, 0)),
            *[
                (f"submit-group{variant}/{size}", submit_group(store, size, **options))
                for variant, options in (
                    ("", {}),
                    ("+sp", {"savepoints": True}),
                    ("+guard", {"guarded": True}),
                )
                for size in groups
            ],
            *[(f"submit-group+1stmt/{size}", submit_statement(store, size)) for size in groups],
            ("watch", lambda: store.watch(watch)),
            ("watch+claims", lambda: store.watch(watch, (), seq_ids)),
        ]
        if "submit-group+guard" in wanted:
            create_guarded(store)
        submits = []
        for _ in range(args.rounds):
            for name, commit in [(n, c) for n, c in shapes if n.split("/")[0] in wanted]:
                cpu, own, heard, wall = measure(
                    cluster, backend, commit, args.commits, listeners.pids
                )
                rows.append([name, f"{cpu:.3f}", f"{own:.3f}", f"{heard:.3f}", f"{wall:.3f}"])
                if name.startswith("submit"):
                    size = int(name.split("/")[1]) if "/" in name else 1
                    submits.append(
                        [
                            name.split("/")[0],
                            str(size),
                            f"{cpu / size:.3f}",
                            f"{own / size:.3f}",
                            f"{wall:.3f}",
                            f"{wall / size:.3f}",
                        ]
                    )
        listeners.close()
        watch.close()
        watched = []
        for _ in range(args.rounds):
            for ms in watch_intervals:
                rate, own, pg = watch_cost(cluster, store, ms / 1000, args.watch_seconds)
                watched.append(
                    [
                        f"{ms:g}",
                        f"{rate:.0f}",
                        f"{own:.3f}",
                        f"{rate * own / 10:.1f}%",
                        f"{pg:.3f}",
                        f"{rate * pg / 10:.1f}%",
                    ]
                )
        with store._connection() as conn:
            time.sleep(1.0)  # statistics reach the views
            upd, hot = conn.execute(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
                "WHERE relname = 'sequences'"
            ).fetchone()
        store.close()
    finally:
        cluster.destroy()
    print(
        f"\n{args.commits} commits per shape, {args.sequences} sequences, "
        f"{args.listeners} listener(s), "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n"
    )
    print_table(
        [
            "commit",
            "PostgreSQL CPU ms / commit",
            "its backend's ms / commit",
            "listeners' ms / commit",
            "wall ms / commit",
        ],
        rows,
    )
    print(f"\nsequence row updates: {upd}, of them HOT: {hot}")
    if submits:
        print()
        print_table(
            [
                "submit",
                "submits / commit",
                "PostgreSQL CPU ms / submit",
                "its backend's ms / submit",
                "wall ms / commit",
                "wall ms / submit",
            ],
            submits,
        )
    if watched:
        print()
        print_table(
            [
                "watch ms",
                "readings/s",
                "thread CPU ms / reading",
                "of a core",
                "PostgreSQL CPU ms / reading",
                "of a core",
            ],
            watched,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
