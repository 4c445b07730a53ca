"""The embedded state store: one SQLite file in WAL mode under --state-dir.

Durability (`--state-fsync`):
- `acks` (default): a change the scheduler acknowledges to a client (Submit, Cancel) is
  committed with synchronous=FULL, so the WAL is fsync'd before the client hears OK and
  survives a power loss. Worker progress (assignments, tokens, finishes) commits with
  synchronous=NORMAL: the commit is in the WAL file, which survives a crash of the
  process (kill -9), but the last moments of progress may be lost on a power loss; the
  sequences then resume from fewer tokens, which seeded sampling regenerates the same.
- `always`: every commit is fsync'd (slower SelectBatch, nothing lost on power loss).
- `never`: no commit is fsync'd (survives kill -9, not a power loss).

Group commit (`defer_fsync=True`, what the server uses): no commit fsyncs on the caller's
thread. Every commit is made with synchronous=NORMAL; those the mode wants durable are
counted (`num_commits_to_sync`), and `sync_wal()`, run on another thread, fsyncs the WAL
file: every commit counted before it started is then durable, exactly as if it had been
made with synchronous=FULL (which only adds that fsync of the WAL to each commit).
service/state/group_commit.py shares one fsync among every commit waiting for it. Automatic
checkpoints are off (they would fsync on the caller's thread); `checkpoint()`, on the
fsync thread, copies the WAL into the database file (SQLite syncs the WAL before and the
database after), and SQLite starts the WAL over from its beginning at a later commit.

One scheduler per directory: a lock file held with flock (released by the kernel when
the process dies, so a restart after kill -9 is never refused).

Tokens: a decode iteration appends one token to each of a worker's running sequences.
A row per sequence per call would cost an index update each; instead each save appends
one `token_log` row holding every append of that call. When a sequence finishes, its
whole output goes to `outputs` in one row, and a log row is deleted once no unfinished
sequence has tokens in it. A restart reads `outputs`, then replays the log.

Integrity (service/state/integrity.py): every row carries a checksum over its columns,
verified at start with everything else a restart reads; a file that fails, cannot be
decoded, or has gone missing where the directory says state was written is refused with
StateDamaged (one line: the file, what is wrong, how to recover). Columns added to
SCHEMA later are added to older files at start, and covered by the checksums unasked.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import sys
import time
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from service.core import ConfigError, FinishReason, SequenceState
from service.core.persist.store import (
    SequenceProgress,
    StateChanges,
    StoredSequence,
    StoredState,
    StoredWorker,
    StoreError,
)
from service.state import integrity as state_integrity
from service.state.integrity import damaged
from service.state.rows import (
    pack_token_ids,
    params_from_row,
    params_json,
    registration_from_json,
    registration_json,
    unpack_token_ids,
)

FSYNC_MODES = ("acks", "always", "never")
DB_NAME = "scheduler.db"
SCHEMA_VERSION = 2

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS sequences (
    seq_id      INTEGER PRIMARY KEY,
    params      TEXT NOT NULL,     -- JSON: everything submitted but the prompt
    prompt      BLOB NOT NULL,     -- uint32 little-endian token ids
    state       INTEGER NOT NULL,  -- SequenceState
    worker_id   TEXT,
    queue_key   INTEGER,           -- ascending = queue order; NULL when not queued
    cursor      INTEGER NOT NULL,
    prefilled_tokens INTEGER NOT NULL,
    num_generated    INTEGER NOT NULL,
    num_generated_at_admission INTEGER NOT NULL,
    finish_reason    INTEGER,      -- FinishReason, NULL until finished
    finish_order     INTEGER NOT NULL DEFAULT 0, -- 1, 2, ... as they finished
    error_message    TEXT NOT NULL DEFAULT '',   -- why it failed, for FAILED
    submitted_at     REAL NOT NULL DEFAULT 0,    -- wall-clock seconds of first submission
    admission_order  INTEGER NOT NULL DEFAULT 0  -- 1, 2, ... as they were admitted
);
CREATE TABLE IF NOT EXISTS outputs (
    seq_id    INTEGER PRIMARY KEY, -- a finished sequence
    token_ids BLOB NOT NULL        -- its whole output, uint32 little-endian
);
CREATE TABLE IF NOT EXISTS token_log (
    id      INTEGER PRIMARY KEY,   -- save order
    entries BLOB NOT NULL          -- uint64 little-endian: (seq_id, start, n, n tokens)*
);
CREATE TABLE IF NOT EXISTS tenant_service (
    tenant TEXT PRIMARY KEY,
    served REAL NOT NULL               -- weighted tokens served so far (the fair order)
);
CREATE TABLE IF NOT EXISTS workers (
    worker_id    TEXT PRIMARY KEY,
    registration TEXT NOT NULL,    -- JSON of RegisterWorkerRequest's fields
    drain_requested INTEGER NOT NULL DEFAULT 0, -- an operator's DrainWorker
    incarnation  INTEGER NOT NULL DEFAULT 0     -- RegisterWorkerResponse.incarnation
);
"""


class SqliteStateStore:
    """StateStore on SQLite; see the module docstring for what survives what."""

    def __init__(
        self, state_dir: str | os.PathLike, fsync: str = "acks", *, defer_fsync: bool = False
    ) -> None:
        if fsync not in FSYNC_MODES:
            raise ConfigError(f"state_fsync must be one of {', '.join(FSYNC_MODES)}, got {fsync!r}")
        self.directory = Path(state_dir)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(
                f"state_dir {str(self.directory)!r}: cannot create it: {err.strerror}"
            ) from None
        self._lock_file = _lock(self.directory)
        self._fsync = fsync
        # Log rows that hold tokens of each unfinished sequence, and how many unfinished
        # sequences each log row still serves.
        self._log_rows_of: dict[int, list[int]] = {}
        self._row_users: dict[int, int] = {}
        self.path = self.directory / DB_NAME
        try:
            self._db = self._open()
        except BaseException:
            self._lock_file.close()
            raise
        self._defer_fsync = defer_fsync
        self.num_commits_to_sync = 0
        self._wal_fd: int | None = None
        self._checkpointer: sqlite3.Connection | None = None
        if defer_fsync:
            self._open_wal()

    def _open(self) -> sqlite3.Connection:
        """Connect, verify what is there, then bring the schema and its checksums up to date."""
        state_integrity.check_file_against_marker(self.path)
        db = None
        try:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._db = db
            state_integrity.connect_function(db)
            db.execute("PRAGMA journal_mode=WAL")
            self._synchronous = ""
            self._set_synchronous("NORMAL")
            state_integrity.check_tables_against_marker(
                self.path, state_integrity.data_tables(db), required="meta"
            )
            self.num_rows_verified = state_integrity.verify(db, self.path)
            db.executescript(SCHEMA)
            # Sealed before the migrations, so that what they write is checksummed, and
            # after, so that the columns they add are covered.
            self._seal()
            self._check_version()
            db.execute("BEGIN IMMEDIATE")
            _add_missing_columns(db)
            db.execute("COMMIT")
            self._seal()
            state_integrity.write_marker(self.path)
            return db
        except sqlite3.Error as err:
            if db is not None:
                db.close()
            raise damaged(self.path, f"not a usable SQLite database ({err})") from None
        except BaseException:
            if db is not None:
                db.close()
            raise

    # ------------------------------------------------------------------ StateStore

    def load(self) -> StoredState:
        """Everything saved; StateDamaged (naming the row) for anything that cannot be read."""
        try:
            return self._load()
        except sqlite3.Error as err:
            raise damaged(self.path, f"cannot be read ({err})") from None

    def _load(self) -> StoredState:
        db = self._db
        rows = db.execute(
            "SELECT seq_id, params, prompt, state, worker_id, queue_key, cursor, "
            "prefilled_tokens, num_generated, num_generated_at_admission, finish_reason, "
            "finish_order, error_message, submitted_at, admission_order FROM sequences "
            "ORDER BY seq_id"
        ).fetchall()
        unfinished = {row[0] for row in rows if row[3] != SequenceState.FINISHED.value}
        tokens = {}
        for seq_id, blob in db.execute("SELECT seq_id, token_ids FROM outputs"):
            with self._decoding("outputs", seq_id):
                tokens[seq_id] = unpack_token_ids(blob)
        self._replay_log(tokens, unfinished)
        sequences = []
        for row in rows:
            with self._decoding("sequences", row[0]):
                sequences.append(
                    StoredSequence(
                        seq_id=row[0],
                        params=params_from_row(row[1], row[2]),
                        progress=SequenceProgress(
                            seq_id=row[0],
                            state=SequenceState(row[3]),
                            worker_id=row[4],
                            queue_key=row[5],
                            cursor=row[6],
                            prefilled_tokens=row[7],
                            num_generated=row[8],
                            num_generated_at_admission=row[9],
                            finish_reason=None if row[10] is None else FinishReason(row[10]),
                            finish_order=row[11],
                            error_message=row[12],
                            submitted_at=row[13],
                            admission_order=row[14],
                        ),
                        output_token_ids=tokens.get(row[0], []),
                    )
                )
        workers = []
        for worker_id, text, drain, incarnation in db.execute(
            "SELECT worker_id, registration, drain_requested, incarnation FROM workers "
            "ORDER BY worker_id"
        ):
            with self._decoding("workers", worker_id):
                workers.append(
                    StoredWorker(registration_from_json(text), bool(drain), _integer(incarnation))
                )
        meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
        tenant_service = {}
        for tenant, served in db.execute("SELECT tenant, served FROM tenant_service"):
            with self._decoding("tenant_service", tenant):
                tenant_service[tenant] = float(served)
        with self._decoding("meta", "next_seq_id/last_incarnation"):
            return StoredState(
                sequences,
                workers,
                next_seq_id=_integer(meta.get("next_seq_id", 1)),
                tenant_service=tenant_service,
                last_incarnation=_integer(meta.get("last_incarnation", 0)),
            )

    @contextmanager
    def _decoding(self, table: str, key) -> Iterator[None]:
        """Turn a row that cannot be decoded into StateDamaged naming it."""
        try:
            yield
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as err:
            raise damaged(
                self.path,
                f"the row of table {table} with key {key!r} cannot be "
                f"decoded ({type(err).__name__}: {err})",
            ) from None

    def _replay_log(self, tokens: dict[int, list[int]], unfinished: set[int]) -> None:
        """Append the logged tokens of unfinished sequences to `tokens`, rebuild the log
        bookkeeping, and delete log rows that no unfinished sequence needs (entries of
        finished or forgotten sequences are skipped: their outputs are whole, or gone)."""
        self._log_rows_of.clear()
        self._row_users.clear()
        unused = []
        for row_id, blob in self._db.execute("SELECT id, entries FROM token_log ORDER BY id"):
            users = 0
            with self._decoding("token_log", row_id):
                entries = list(_log_entries(blob))
            for seq_id, start, token_ids in entries:
                if seq_id not in unfinished:
                    continue
                out = tokens.setdefault(seq_id, [])
                if start != len(out):
                    raise damaged(
                        self.path,
                        f"seq_id {seq_id} has tokens from {start} after "
                        f"{len(out)} tokens (token_log row {row_id})",
                    )
                out.extend(token_ids)
                self._log_rows_of.setdefault(seq_id, []).append(row_id)
                users += 1
            if users:
                self._row_users[row_id] = users
            else:
                unused.append((row_id,))
        if unused:
            try:
                self._db.executemany("DELETE FROM token_log WHERE id = ?", unused)
            except sqlite3.Error as err:
                raise StoreError(f"cannot clean the token log of {self.path}: {err}") from None

    def save(self, changes: StateChanges) -> None:
        db = self._db
        sync = self._fsync == "always" or (self._fsync == "acks" and changes.sync)
        try:
            self._set_synchronous("FULL" if sync and not self._defer_fsync else "NORMAL")
            db.execute("BEGIN IMMEDIATE")
            self._write(changes)
            done = {seq_id for seq_id, _ in changes.final_outputs} | set(changes.forgotten)
            log_row, users = self._append_log(changes, done)
            freed = self._free_log_rows(done)
            db.execute("COMMIT")
        except BaseException as err:
            # SQLite rolls back by itself after most errors, maybe not after a failed
            # COMMIT: leave no transaction open for the next save, whatever failed.
            if db.in_transaction:
                try:
                    db.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
            if isinstance(err, sqlite3.Error):
                raise StoreError(f"cannot save scheduler state to {self.path}: {err}") from None
            raise
        if sync and self._defer_fsync:
            self.num_commits_to_sync += 1
        self._note_log_rows(done, freed, log_row, users)

    def close(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.close()
        if self._wal_fd is not None:
            os.close(self._wal_fd)
        self._db.close()
        self._lock_file.close()

    # ------------------------------------------------------------------ group commit

    def sync_wal(self) -> None:
        """fsync the WAL: every commit made before this call survives a power loss.

        Safe on another thread than the one saving (it touches no connection). fdatasync
        where there is one, as SQLite itself uses: the WAL's data and its size, not its
        timestamps."""
        try:
            _fdatasync(self._wal_fd)
        except OSError as err:
            raise StoreError(f"cannot fsync {self.path.name}-wal: {err.strerror}") from None

    def wal_bytes(self) -> int:
        """The WAL file's size now (it grows until a checkpoint lets SQLite start it over)."""
        return os.fstat(self._wal_fd).st_size

    def checkpoint(self) -> None:
        """Copy the WAL into the database file, on the fsync thread (its own connection)."""
        try:
            if self._checkpointer is None:
                self._checkpointer = sqlite3.connect(
                    self.path, isolation_level=None, check_same_thread=False
                )
                self._checkpointer.execute("PRAGMA synchronous=NORMAL")
            self._checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)")
        except sqlite3.Error as err:
            raise StoreError(f"cannot checkpoint {self.path.name}: {err}") from None

    def _open_wal(self) -> None:
        """Keep the WAL open for sync_wal; autocheckpoints off (they would fsync here)."""
        self._db.execute("PRAGMA wal_autocheckpoint=0")
        wal = Path(f"{self.path}-wal")
        try:
            self._wal_fd = os.open(wal, os.O_RDONLY)
            # The WAL's directory entry must last too: once, as SQLite would on its own sync.
            directory_fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(directory_fd)
            finally:
                os.close(directory_fd)
        except OSError as err:
            self.close()
            raise ConfigError(
                f"state_dir {str(self.directory)!r}: cannot open {wal.name} "
                f"to sync it: {err.strerror}"
            ) from None

    # ------------------------------------------------------------------ internals

    def _write(self, changes: StateChanges) -> None:
        db = self._db
        # A sequence created in this change goes in with its progress in one INSERT.
        created = {seq_id: params for seq_id, params in changes.created}
        if created:
            progress_of = {p.seq_id: p for p in changes.progress if p.seq_id in created}
            db.executemany(
                f"INSERT INTO sequences (seq_id, params, prompt, {_PROGRESS_COLUMNS}) "
                f"VALUES (?, ?, ?, {', '.join('?' * len(_PROGRESS_FIELDS))})",
                [
                    (
                        seq_id,
                        params_json(params),
                        pack_token_ids(params.prompt_token_ids),
                        *_progress_values(
                            progress_of.get(seq_id)
                            or SequenceProgress(
                                seq_id, SequenceState.QUEUED, None, None, 0, 0, 0, 0, None
                            )
                        ),
                    )
                    for seq_id, params in created.items()
                ],
            )
        updated = [p for p in changes.progress if p.seq_id not in created]
        if updated:
            db.executemany(
                f"UPDATE sequences SET {' = ?, '.join(_PROGRESS_FIELDS)} = ? WHERE seq_id = ?",
                [(*_progress_values(p), p.seq_id) for p in updated],
            )
        if changes.final_outputs:
            db.executemany(
                "INSERT OR REPLACE INTO outputs (seq_id, token_ids) VALUES (?, ?)",
                [(seq_id, pack_token_ids(output)) for seq_id, output in changes.final_outputs],
            )
        if changes.workers_changed:
            db.executemany(
                "INSERT OR REPLACE INTO workers (worker_id, registration, "
                "drain_requested, incarnation) VALUES (?, ?, ?, ?)",
                [
                    (
                        w.registration.worker_id,
                        registration_json(w.registration),
                        int(w.drain_requested),
                        w.incarnation,
                    )
                    for w in changes.workers_changed
                ],
            )
        if changes.workers_left:
            db.executemany(
                "DELETE FROM workers WHERE worker_id = ?", [(w,) for w in changes.workers_left]
            )
        if changes.forgotten:
            ids = [(seq_id,) for seq_id in changes.forgotten]
            db.executemany("DELETE FROM sequences WHERE seq_id = ?", ids)
            db.executemany("DELETE FROM outputs WHERE seq_id = ?", ids)
        if changes.next_seq_id is not None:
            db.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES ('next_seq_id', ?)",
                (changes.next_seq_id,),
            )
        if changes.last_incarnation is not None:
            db.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES ('last_incarnation', ?)",
                (changes.last_incarnation,),
            )
        if changes.tenant_service:
            db.executemany(
                "INSERT OR REPLACE INTO tenant_service (tenant, served) VALUES (?, ?)",
                changes.tenant_service,
            )

    def _append_log(self, changes: StateChanges, done: set[int]) -> tuple[int | None, set[int]]:
        """One log row with this save's appends, but those of sequences that finish in
        it (their whole output goes to `outputs`); returns (its id, the sequences in it)."""
        entries, users = array("Q"), set()
        for t in changes.tokens:
            if t.seq_id not in done:
                entries.extend((t.seq_id, t.start, len(t.token_ids)))
                entries.extend(t.token_ids)
                users.add(t.seq_id)
        if not users:
            return None, users
        if sys.byteorder == "big":
            entries.byteswap()
        row = self._db.execute(
            "INSERT INTO token_log (entries) VALUES (?)", (entries.tobytes(),)
        ).lastrowid
        return row, users

    def _free_log_rows(self, done: set[int]) -> list[int]:
        """Delete the log rows that only sequences finished by now used; returns them."""
        released: dict[int, int] = {}
        for seq_id in done:
            for row in self._log_rows_of.get(seq_id, ()):
                released[row] = released.get(row, 0) + 1
        freed = [row for row, count in released.items() if count == self._row_users[row]]
        if freed:
            self._db.executemany("DELETE FROM token_log WHERE id = ?", [(r,) for r in freed])
        return freed

    def _note_log_rows(
        self, done: set[int], freed: list[int], log_row: int | None, users: set[int]
    ) -> None:
        """Bring the log bookkeeping up to date once a save has committed."""
        for seq_id in done:
            for row in self._log_rows_of.pop(seq_id, ()):
                self._row_users[row] -= 1
        for row in freed:
            del self._row_users[row]
        if log_row is not None:
            self._row_users[log_row] = len(users)
            for seq_id in users:
                self._log_rows_of.setdefault(seq_id, []).append(log_row)

    def _seal(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")
        state_integrity.seal(self._db)
        self._db.execute("COMMIT")

    def _set_synchronous(self, level: str) -> None:
        if level != self._synchronous:
            self._db.execute(f"PRAGMA synchronous={level}")
            self._synchronous = level

    def _check_version(self) -> None:
        row = self._db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        if row is None:
            self._db.execute(
                "INSERT INTO meta (key, value) VALUES ('schema_version', ?)", (SCHEMA_VERSION,)
            )
        elif row[0] == 1:
            self._migrate_from_version_1()
        elif row[0] != SCHEMA_VERSION:
            raise sqlite3.DatabaseError(
                f"schema version {row[0]}, this scheduler reads version {SCHEMA_VERSION}"
            )

    def _migrate_from_version_1(self) -> None:
        """Version 2 dates first submissions and numbers admissions (the fair order and
        preemption victims); sequences of version 1 count as submitted now."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        _add_missing_columns(db)
        db.execute("UPDATE sequences SET submitted_at = ? WHERE submitted_at = 0", (time.time(),))
        db.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (SCHEMA_VERSION,))
        db.execute("COMMIT")


def _add_missing_columns(db: sqlite3.Connection) -> None:
    """Add to each table the columns SCHEMA declares that the file's table lacks (a file
    written by an older scheduler), with their declared defaults."""
    declared = sqlite3.connect(":memory:")
    try:
        declared.executescript(SCHEMA)
        for (table,) in declared.execute("SELECT name FROM sqlite_master WHERE type = 'table'"):
            present = {row[1] for row in db.execute(f"PRAGMA main.table_info({table})")}
            for _, name, kind, not_null, default, _ in declared.execute(
                f"PRAGMA table_info({table})"
            ):
                if name not in present:
                    db.execute(
                        f"ALTER TABLE {table} ADD COLUMN {name} {kind}"
                        f"{' NOT NULL' if not_null else ''}"
                        f"{f' DEFAULT {default}' if default is not None else ''}"
                    )
    finally:
        declared.close()


def _integer(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


_fdatasync = getattr(os, "fdatasync", os.fsync)


def _lock(directory: Path):
    lock_file = open(directory / "lock", "a+")  # held for the store's life
    try:
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock_file.close()
        raise ConfigError(
            f"state_dir {str(directory)!r} is in use by another scheduler "
            "process; give each scheduler its own --state-dir"
        ) from None
    return lock_file


def _log_entries(blob: bytes):
    """(seq_id, start, token_ids) of each append in one token_log row."""
    entries = array("Q")
    entries.frombytes(blob)
    if sys.byteorder == "big":
        entries.byteswap()
    i = 0
    while i < len(entries):
        seq_id, start, count = entries[i], entries[i + 1], entries[i + 2]
        yield seq_id, start, entries[i + 3 : i + 3 + count].tolist()
        i += 3 + count


# The columns of a sequence's progress (SequenceProgress, but for its seq_id), in order.
_PROGRESS_FIELDS = (
    "state",
    "worker_id",
    "queue_key",
    "cursor",
    "prefilled_tokens",
    "num_generated",
    "num_generated_at_admission",
    "finish_reason",
    "finish_order",
    "error_message",
    "submitted_at",
    "admission_order",
)
_PROGRESS_COLUMNS = ", ".join(_PROGRESS_FIELDS)


def _progress_values(p: SequenceProgress) -> tuple:
    return (
        p.state.value,
        p.worker_id,
        p.queue_key,
        p.cursor,
        p.prefilled_tokens,
        p.num_generated,
        p.num_generated_at_admission,
        None if p.finish_reason is None else p.finish_reason.value,
        p.finish_order,
        p.error_message,
        p.submitted_at,
        p.admission_order,
    )
