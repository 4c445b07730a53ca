"""State integrity: a state directory that lost or changed what it held is refused in one
line naming the file, what is wrong and how to recover; never started empty in silence.

Each damage here is one the outside probe made (a zero-length file, random bytes, a bad
enum value, bytes changed inside stored values), or its neighbour.
"""

from __future__ import annotations

import os
import re
import sqlite3

import pytest

from service.core import ConfigError, FinishReason, Scheduler, SequenceState
from service.state import integrity as state_integrity
from service.state import sqlite as state_sqlite
from service.state.check import CannotCheck, check
from service.state.integrity import StateDamaged, row_checksum
from service.state.sqlite import SqliteStateStore

from .factories import (
    FakeClock,
    admit,
    finished,
    make_config,
    register,
    report,
    submit,
    write_version_1_state_dir,
)

RECOVERY = "restore the directory from a backup, or move it aside to start with empty state"


def _written(state_dir, num_sequences: int = 5) -> list[int]:
    """A state dir holding queued, running (with tokens) and finished sequences, a worker."""
    store = SqliteStateStore(state_dir)
    sched = Scheduler(make_config(max_batch_size=2), clock=FakeClock(), store=store)
    ids = [submit(sched, prompt_len=4, max_new_tokens=30) for _ in range(num_sequences)]
    register(sched)
    admit(sched)
    sched.select_batch(report(running=ids[:2], tokens={ids[0]: [7, 8], ids[1]: [9]}))
    sched.select_batch(report(running=ids[1:2], finished=[finished(ids[0], FinishReason.EOS, 2)]))
    store.close()
    return ids


def _sql(state_dir, statement: str, *args) -> None:
    db = sqlite3.connect(state_dir / "scheduler.db")
    db.execute(statement, args)
    db.commit()
    db.close()


def _refused(state_dir, match: str) -> str:
    with pytest.raises(StateDamaged) as info:
        SqliteStateStore(state_dir).load()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{state_dir / 'scheduler.db'}: ")
    assert RECOVERY in message
    assert re.search(match, message), message
    return message


def test_a_sound_directory_loads_and_checks_sound(tmp_path):
    ids = _written(tmp_path)
    report_ = check(tmp_path)
    assert report_.states == {
        SequenceState.QUEUED: 2,
        SequenceState.PREFILLING: 1,
        SequenceState.DECODING: 1,
        SequenceState.FINISHED: 1,
    }
    assert report_.num_rows_verified > len(ids)
    assert " sound: " in report_.line()
    assert len(SqliteStateStore(tmp_path).load().sequences) == len(ids)


def test_a_zero_length_database_where_state_was_written_is_refused(tmp_path):
    """Regression: it started empty with no warning (300 sequences silently gone)."""
    _written(tmp_path)
    (tmp_path / "scheduler.db").write_bytes(b"")
    _refused(
        tmp_path,
        r"the file is empty \(0 bytes\), but scheduler.db.written says state "
        r"was written here",
    )


def test_a_missing_database_where_state_was_written_is_refused(tmp_path):
    _written(tmp_path)
    for name in ("scheduler.db", "scheduler.db-wal", "scheduler.db-shm"):
        if (tmp_path / name).exists():
            os.remove(tmp_path / name)
    _refused(tmp_path, r"the file is missing, but scheduler.db.written says")


def test_a_database_without_our_tables_where_state_was_written_is_refused(tmp_path):
    _written(tmp_path)
    os.remove(tmp_path / "scheduler.db")
    fresh = sqlite3.connect(tmp_path / "scheduler.db")  # a fresh database, no tables
    fresh.execute("PRAGMA user_version = 7")
    fresh.close()
    _refused(tmp_path, r"the file has no tables, but scheduler.db.written says")


def test_random_bytes_are_refused(tmp_path):
    """Regression: random bytes gave a raw traceback and exit 1."""
    _written(tmp_path)
    (tmp_path / "scheduler.db").write_bytes(os.urandom(8192))
    _refused(tmp_path, r"not a usable SQLite database")


def test_a_changed_prompt_token_fails_its_checksum(tmp_path):
    """Regression: bytes changed inside a stored value were accepted silently."""
    ids = _written(tmp_path)
    (prompt,) = (
        sqlite3.connect(tmp_path / "scheduler.db")
        .execute("SELECT prompt FROM sequences WHERE seq_id = ?", (ids[3],))
        .fetchone()
    )
    changed = bytes([prompt[0] ^ 1]) + prompt[1:]
    _sql(tmp_path, "UPDATE sequences SET prompt = ? WHERE seq_id = ?", changed, ids[3])
    _refused(tmp_path, rf"the row of table sequences with seq_id={ids[3]} fails its checksum")


def test_a_changed_max_new_tokens_fails_its_checksum(tmp_path):
    """Regression: max_new_tokens 30 -> 90 in the stored params was accepted silently."""
    ids = _written(tmp_path)
    _sql(
        tmp_path,
        "UPDATE sequences SET params = replace(params, '\"max_new_tokens\": 30', "
        "'\"max_new_tokens\": 90') WHERE seq_id = ?",
        ids[2],
    )
    _refused(tmp_path, rf"table sequences with seq_id={ids[2]} fails its checksum")


@pytest.mark.parametrize("table", ["outputs", "token_log", "workers", "meta"])
def test_a_changed_row_of_any_table_fails_its_checksum(tmp_path, table):
    _written(tmp_path)
    db = sqlite3.connect(tmp_path / "scheduler.db")
    columns = [r[1] for r in db.execute(f"PRAGMA table_info({table})")]
    victim = next(c for c in reversed(columns) if c != "row_crc")
    (rowid, value) = db.execute(f"SELECT rowid, {victim} FROM {table} LIMIT 1").fetchone()
    changed = (
        value + b"\0\0\0\0"
        if isinstance(value, bytes)
        else (value + 1 if isinstance(value, int) else value + "x")
    )
    db.execute(f"UPDATE {table} SET {victim} = ? WHERE rowid = ?", (changed, rowid))
    db.commit()
    db.close()
    _refused(tmp_path, rf"the row of table {table} with .* fails its checksum")


def test_a_bad_enum_value_is_refused_naming_the_row_even_with_a_matching_checksum(tmp_path):
    """Regression: a bad enum value gave a raw traceback. Here its checksum is recomputed,
    as a bug in the scheduler itself would have stored it."""
    ids = _written(tmp_path)
    db = sqlite3.connect(tmp_path / "scheduler.db")
    state_integrity.connect_function(db)
    columns = db.execute(
        "SELECT columns FROM checksummed_columns WHERE table_name = 'sequences'"
    ).fetchone()[0]
    db.execute(f"UPDATE sequences SET state = 9 WHERE seq_id = {ids[4]}")
    db.execute(f"UPDATE sequences SET row_crc = lattice_row_crc({columns}) WHERE seq_id = {ids[4]}")
    db.commit()
    db.close()
    _refused(
        tmp_path,
        rf"the row of table sequences with key {ids[4]} cannot be decoded "
        r"\(ValueError: 9 is not a valid SequenceState\)",
    )


def test_undecodable_params_are_refused_naming_the_row(tmp_path):
    ids = _written(tmp_path)
    db = sqlite3.connect(tmp_path / "scheduler.db")
    state_integrity.connect_function(db)
    columns = db.execute(
        "SELECT columns FROM checksummed_columns WHERE table_name = 'sequences'"
    ).fetchone()[0]
    db.execute(f"UPDATE sequences SET params = '{{not json' WHERE seq_id = {ids[0]}")
    db.execute(f"UPDATE sequences SET row_crc = lattice_row_crc({columns}) WHERE seq_id = {ids[0]}")
    db.commit()
    db.close()
    _refused(tmp_path, rf"table sequences with key {ids[0]} cannot be decoded \(JSONDecodeError")


def test_the_store_refuses_with_a_config_error_so_serve_exits_2(tmp_path):
    _written(tmp_path)
    (tmp_path / "scheduler.db").write_bytes(b"")
    with pytest.raises(ConfigError):
        SqliteStateStore(tmp_path)


def test_an_empty_directory_starts_fresh_and_says_so_with_a_marker(tmp_path):
    store = SqliteStateStore(tmp_path / "new")
    store.close()
    assert (tmp_path / "new" / "scheduler.db.written").is_file()


def test_a_file_written_before_checksums_is_adopted_and_covered_from_then_on(tmp_path):
    """A state dir of an older scheduler (no row_crc, no marker, fewer columns) starts, and
    from then on its rows are checked."""
    write_version_1_state_dir(tmp_path, {1: 0}, request_id="r")
    (seq,) = SqliteStateStore(tmp_path).load().sequences
    assert (seq.params.prompt_token_ids, seq.progress.error_message) == ((5, 6), "")
    _sql(tmp_path, "UPDATE sequences SET cursor = 3")
    _refused(tmp_path, "fails its checksum")


def test_a_column_added_to_the_schema_later_is_covered_without_checksum_code(tmp_path, monkeypatch):
    """Another developer adds a column (and a table) to SCHEMA: an existing file gets them,
    its old checksums are verified first, and the new column is covered from then on."""
    ids = _written(tmp_path)
    monkeypatch.setattr(
        state_sqlite,
        "SCHEMA",
        state_sqlite.SCHEMA.replace(
            "error_message    TEXT NOT NULL DEFAULT ''",
            "error_message    TEXT NOT NULL DEFAULT '',\n    first_submitted_at REAL NOT NULL "
            "DEFAULT 0",
        )
        + "\nCREATE TABLE IF NOT EXISTS tenants (tenant TEXT PRIMARY KEY, "
        "served INTEGER NOT NULL);",
    )
    store = SqliteStateStore(tmp_path)
    store._db.execute("INSERT INTO tenants (tenant, served) VALUES ('t', 5)")
    store.close()
    assert len(SqliteStateStore(tmp_path).load().sequences) == len(ids)
    _sql(tmp_path, "UPDATE sequences SET first_submitted_at = 1.5 WHERE seq_id = ?", ids[1])
    _refused(tmp_path, rf"sequences with seq_id={ids[1]} fails its checksum")
    _sql(tmp_path, "UPDATE sequences SET first_submitted_at = 0 WHERE seq_id = ?", ids[1])
    SqliteStateStore(tmp_path).close()
    _sql(tmp_path, "UPDATE tenants SET served = 6")
    _refused(tmp_path, r"table tenants with tenant='t' fails its checksum")


def test_the_checksum_covers_type_position_and_value():
    assert (
        len(
            {
                row_checksum(1, "2"),
                row_checksum("1", 2),
                row_checksum(2, 1),
                row_checksum(12),
                row_checksum("1", "2"),
                row_checksum(b"12"),
                row_checksum(None, 12),
                row_checksum(12.0),
            }
        )
        == 8
    )


# ------------------------------------------------------------------------ state check


def test_state_check_names_the_checked_directory_not_its_scratch_copy(tmp_path):
    ids = _written(tmp_path)
    _sql(tmp_path, "UPDATE sequences SET cursor = 99 WHERE seq_id = ?", ids[3])
    with pytest.raises(StateDamaged) as info:
        check(tmp_path)
    assert str(info.value).startswith(
        f"{tmp_path / 'scheduler.db'}: the row of table "
        f"sequences with seq_id={ids[3]} fails its checksum"
    )


def test_state_check_changes_nothing_in_the_directory(tmp_path):
    _written(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    check(tmp_path)
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert after == before


def test_state_check_refuses_a_directory_in_use(tmp_path):
    _written(tmp_path)
    store = SqliteStateStore(tmp_path)
    try:
        with pytest.raises(CannotCheck, match="in use by a running scheduler"):
            check(tmp_path)
    finally:
        store.close()


@pytest.mark.parametrize("make", ["missing", "not_state"])
def test_state_check_of_something_that_is_not_a_state_directory_cannot_check(tmp_path, make):
    target = tmp_path / "nowhere" if make == "missing" else tmp_path
    with pytest.raises(CannotCheck):
        check(target)


def test_state_check_command_exit_codes_and_one_line(tmp_path, capsys):
    from service.cli.main import main

    _written(tmp_path / "good")
    assert main(["state", "check", str(tmp_path / "good")]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and " sound: " in out
    _written(tmp_path / "bad")
    (tmp_path / "bad" / "scheduler.db").write_bytes(b"")
    assert main(["state", "check", str(tmp_path / "bad")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the file is empty" in err
    assert main(["state", "check", str(tmp_path / "nowhere")]) == 2


def test_rows_a_migration_rewrites_at_start_are_checksummed(tmp_path, monkeypatch):
    """A schema migration (in _check_version, in its own transaction) that changes values
    leaves checksums that still verify at the next start."""
    ids = _written(tmp_path)
    real = SqliteStateStore._check_version

    def migrating(store):
        real(store)
        store._db.execute("BEGIN IMMEDIATE")
        store._db.execute("UPDATE sequences SET finish_order = finish_order + 100")
        store._db.execute("COMMIT")

    monkeypatch.setattr(SqliteStateStore, "_check_version", migrating)
    SqliteStateStore(tmp_path).close()
    monkeypatch.undo()
    store = SqliteStateStore(tmp_path)
    assert len(store.load().sequences) == len(ids)
    store.close()
