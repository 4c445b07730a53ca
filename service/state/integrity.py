"""Integrity of the state directory: a checksum on every stored row, and a marker file that
says state was written here.

Checksums. Every table of the state file gets a `row_crc` column: a CRC-32 over all of the
row's other columns, in the order recorded for that table in `checksummed_columns`.
Triggers (created on each connection, from the table's columns as they are) keep it up to
date on every INSERT and UPDATE, so a column or table added to the schema later is covered
without anyone writing checksum code for it. When the columns of a table change (an
upgrade added one), its rows are verified against the old column list, then sealed again
with the new one. At start every row is verified before anything is read or written.

Marker. Once a state file has its tables, `scheduler.db.written` is created beside it. A
directory with the marker whose `scheduler.db` is missing, empty or without tables has
lost its state: the scheduler refuses to start there rather than start empty in silence.

Every refusal is a `StateDamaged`: one line naming the file, what is wrong, and how to
recover.
"""

from __future__ import annotations

import os
import sqlite3
import zlib
from pathlib import Path

from service.core import ConfigError

CHECKSUM_COLUMN = "row_crc"
# table_name -> the columns (comma-separated, in order) that its rows' checksums cover.
COLUMNS_TABLE = "checksummed_columns"
MARKER_SUFFIX = ".written"
_FUNCTION = "lattice_row_crc"
_EVENTS = ("INSERT", "UPDATE")
_RECOVER = (
    "restore the directory from a backup, or move it aside to start with empty "
    "state (see docs/operations.md, Durable state)"
)


class StateDamaged(ConfigError):
    """The state directory cannot be trusted: the scheduler must not start on it."""


def damaged(path: Path, what: str) -> StateDamaged:
    """`path`: what is wrong, and how to recover, in one line."""
    return StateDamaged(f"{path}: {what}; {_RECOVER}")


# ------------------------------------------------------------------------ checksums


def row_checksum(*values) -> int:
    """CRC-32 over a row's values in order, each with its type (so that neither a value
    moved across columns nor a changed type goes unnoticed).

    The values are SQLite's: None, int, float, str, bytes. Their repr() is exact and stable
    (quotes and escapes included) and tells the types apart; a blob enters as its length
    in the repr, a 1-tuple no other value can be, and its bytes are checksummed as they are
    (cheap for the large token blobs). Called for every row written, so kept lean.
    """
    if bytes not in map(type, values):
        return zlib.crc32(repr(values).encode())
    crc, shape = 0, []
    for value in values:
        if type(value) is bytes:
            crc = zlib.crc32(value, crc)
            shape.append((len(value),))
        else:
            shape.append(value)
    return zlib.crc32(repr(shape).encode(), crc)


def connect_function(db: sqlite3.Connection) -> None:
    """Make the checksum function callable from SQL on `db` (the triggers need it)."""
    db.create_function(_FUNCTION, -1, row_checksum, deterministic=True)


def data_tables(db: sqlite3.Connection) -> list[str]:
    """The tables that hold state (SQLite's own and the column records left out)."""
    return [
        name
        for (name,) in db.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' "
            "AND name != ? ORDER BY name",
            (COLUMNS_TABLE,),
        )
    ]


def verify(db: sqlite3.Connection, path: Path) -> int:
    """Check every row of every table against its checksum; returns how many were checked.

    A table that has no checksum column yet (written before checksums existed) is
    skipped: `seal` covers it from now on. Raises StateDamaged at the first bad row.
    """
    recorded = _recorded_columns(db)
    num_rows = 0
    for table in data_tables(db):
        present = _columns(db, table)
        if CHECKSUM_COLUMN not in present:
            continue
        columns = recorded.get(table)
        if columns is None:
            raise damaged(
                path,
                f"table {table} has checksums but no record of the columns "
                f"they cover ({COLUMNS_TABLE} lost it)",
            )
        missing = [c for c in columns if c not in present]
        if missing:
            raise damaged(path, f"table {table} lacks its column(s) {', '.join(missing)}")
        keys = _key_columns(db, table)
        selected = ", ".join(_quote(c) for c in (*keys, CHECKSUM_COLUMN, *columns))
        for row in db.execute(f"SELECT {selected} FROM {_quote(table)}"):
            key, stored, values = row[: len(keys)], row[len(keys)], row[len(keys) + 1 :]
            computed = row_checksum(*values)
            if stored != computed:
                where = ", ".join(f"{k}={v!r}" for k, v in zip(keys, key))
                stored_text = "none" if stored is None else f"{stored:08x}"
                raise damaged(
                    path,
                    f"the row of table {table} with {where} fails its "
                    f"checksum (stored {stored_text}, computed "
                    f"{computed:08x}): the file was changed outside the "
                    "scheduler or is damaged",
                )
            num_rows += 1
    return num_rows


def seal(db: sqlite3.Connection) -> None:
    """Give every table its checksum column and up-to-date checksums, then the triggers
    that keep them so. Call after `verify`, inside the transaction that sets up the schema.
    """
    db.execute(
        f"CREATE TABLE IF NOT EXISTS {COLUMNS_TABLE} ("
        "table_name TEXT PRIMARY KEY, columns TEXT NOT NULL)"
    )
    recorded = _recorded_columns(db)
    for table in data_tables(db):
        _drop_triggers(db, table)  # made from the old columns, they would undo a reseal
        if CHECKSUM_COLUMN not in _columns(db, table):
            db.execute(f"ALTER TABLE {_quote(table)} ADD COLUMN {CHECKSUM_COLUMN} INTEGER")
        columns = [c for c in _columns(db, table) if c != CHECKSUM_COLUMN]
        if recorded.get(table) != columns:
            db.execute(
                f"UPDATE {_quote(table)} SET {CHECKSUM_COLUMN} = "
                f"{_FUNCTION}({', '.join(_quote(c) for c in columns)})"
            )
            db.execute(
                f"INSERT OR REPLACE INTO {COLUMNS_TABLE} (table_name, columns) VALUES (?, ?)",
                (table, ",".join(columns)),
            )
        _create_triggers(db, table, columns)


def _create_triggers(db: sqlite3.Connection, table: str, columns: list[str]) -> None:
    """TEMP triggers (this connection only; nothing foreign stored in the file) that set
    the checksum of each inserted or updated row. Recursive triggers are off (SQLite's
    default), so the trigger's own UPDATE does not fire it again."""
    values = ", ".join(f"NEW.{_quote(c)}" for c in columns)
    for event in _EVENTS:
        db.execute(
            f"CREATE TEMP TRIGGER {_trigger(table, event)} AFTER {event} ON "
            f"main.{_quote(table)} BEGIN UPDATE {_quote(table)} SET {CHECKSUM_COLUMN} "
            f"= {_FUNCTION}({values}) WHERE rowid = NEW.rowid; END"
        )


def _drop_triggers(db: sqlite3.Connection, table: str) -> None:
    for event in _EVENTS:
        db.execute(f"DROP TRIGGER IF EXISTS temp.{_trigger(table, event)}")


def _trigger(table: str, event: str) -> str:
    return _quote(f"{table}_{event.lower()}_{CHECKSUM_COLUMN}")


def _recorded_columns(db: sqlite3.Connection) -> dict[str, list[str]]:
    if COLUMNS_TABLE not in {
        n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
    }:
        return {}
    return {
        table: columns.split(",")
        for table, columns in db.execute(f"SELECT table_name, columns FROM {COLUMNS_TABLE}")
    }


def _columns(db: sqlite3.Connection, table: str) -> list[str]:
    return [row[1] for row in db.execute(f"PRAGMA main.table_info({_quote(table)})")]


def _key_columns(db: sqlite3.Connection, table: str) -> list[str]:
    info = sorted(
        (row[5], row[1])
        for row in db.execute(f"PRAGMA main.table_info({_quote(table)})")
        if row[5] > 0
    )
    return [name for _, name in info] or ["rowid"]


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


# ------------------------------------------------------------------------ marker


def marker_path(db_path: Path) -> Path:
    return db_path.with_name(db_path.name + MARKER_SUFFIX)


def check_file_against_marker(db_path: Path) -> None:
    """Before opening: refuse a missing or empty state file where the marker says state
    was written."""
    marker = marker_path(db_path)
    if not marker.exists():
        return
    if not db_path.exists():
        raise damaged(
            db_path, f"the file is missing, but {marker.name} says state was written here"
        )
    if db_path.stat().st_size == 0:
        raise damaged(
            db_path, f"the file is empty (0 bytes), but {marker.name} says state was written here"
        )


def check_tables_against_marker(db_path: Path, tables: list[str], required: str) -> None:
    """After opening: refuse a file without our tables where the marker says state was
    written (a fresh, foreign or emptied database in its place)."""
    marker = marker_path(db_path)
    if marker.exists() and required not in tables:
        found = f"tables {', '.join(tables)}" if tables else "no tables"
        raise damaged(
            db_path,
            f"the file has {found}, but {marker.name} says state was "
            f"written here (a {required} table at least)",
        )


def write_marker(db_path: Path) -> None:
    """Say, durably, that state is written in `db_path` from now on (idempotent)."""
    marker = marker_path(db_path)
    if marker.exists():
        return
    text = (
        f"{db_path.name} in this directory holds a lattice-scheduler's state. If it is "
        "missing or empty, that state was lost: the scheduler refuses to start until "
        "the directory is restored from a backup, or moved aside to start with empty "
        "state.\n"
    )
    partial = marker.with_name(marker.name + ".tmp")
    with open(partial, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, marker)
    fd = os.open(marker.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
