"""What row checksums cost: writing rows with and without the checksum triggers, side by
side, and verifying a state file at start.

    .venv/bin/python -m bench.state_integrity [--rows 256] [--rounds 200]
        [--verify-sequences 20000] [--tmp-dir .artifacts]

Rows are written as the scheduler writes them (SQLite in WAL mode, synchronous=NORMAL, one
transaction per round): `--rows` sequence progress rows updated per round (as a SelectBatch
that admits or continues that many sequences), and one token_log row of `--rows` one-token
appends (as a decode step). Then a store holding `--verify-sequences` finished sequences of
32 tokens each is opened, and the time its checks take (every row's checksum) is printed
next to loading it.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from array import array
from pathlib import Path

from service.state import integrity as state_integrity
from service.state.sqlite import SCHEMA, SqliteStateStore

PARAMS = (
    '{"request_id": "", "max_new_tokens": 30, "adapter_id": "", "priority": 0, '
    '"tenant": "", "sampling": [0.0, 0.0, 0, 0], "stop_token_ids": []}'
)


def _database(directory: str, checksums: bool, num_rows: int) -> sqlite3.Connection:
    db = sqlite3.connect(os.path.join(directory, "bench.db"), isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.executescript(SCHEMA)
    if checksums:
        state_integrity.connect_function(db)
        db.execute("BEGIN")
        state_integrity.seal(db)
        db.execute("COMMIT")
    prompt = array("I", range(64)).tobytes()
    db.execute("BEGIN")
    db.executemany(
        "INSERT INTO sequences (seq_id, params, prompt, state, cursor, "
        "prefilled_tokens, num_generated, num_generated_at_admission) "
        "VALUES (?, ?, ?, 1, 0, 0, 0, 0)",
        [(i, PARAMS, prompt) for i in range(num_rows)],
    )
    db.execute("COMMIT")
    return db


def _write_rounds(db: sqlite3.Connection, num_rows: int, rounds: int) -> tuple[float, float]:
    """Median microseconds per round: (progress rows updated, one token_log row)."""
    entries = array("Q")
    for seq_id in range(num_rows):
        entries.extend((seq_id, 0, 1, 7))
    blob = entries.tobytes()
    progress, log = [], []
    for r in range(rounds):
        rows = [(3, "w0", None, 64, 64, r, 0, None, 0, "", i) for i in range(num_rows)]
        started = time.perf_counter()
        db.execute("BEGIN IMMEDIATE")
        db.executemany(
            "UPDATE sequences SET state = ?, worker_id = ?, queue_key = ?, "
            "cursor = ?, prefilled_tokens = ?, num_generated = ?, "
            "num_generated_at_admission = ?, finish_reason = ?, finish_order = ?, "
            "error_message = ? WHERE seq_id = ?",
            rows,
        )
        db.execute("COMMIT")
        progress.append(time.perf_counter() - started)
        started = time.perf_counter()
        db.execute("BEGIN IMMEDIATE")
        db.execute("INSERT INTO token_log (entries) VALUES (?)", (blob,))
        db.execute("COMMIT")
        log.append(time.perf_counter() - started)
    return statistics.median(progress) * 1e6, statistics.median(log) * 1e6


def _verify_figures(directory: str, num_sequences: int) -> tuple[int, float, float]:
    """(rows verified, seconds to open the store (checks included), seconds to load)."""
    state_dir = Path(directory) / "state"
    store = SqliteStateStore(state_dir)
    db = store._db
    output = array("I", range(32)).tobytes()
    prompt = array("I", range(64)).tobytes()
    db.execute("BEGIN")
    db.executemany(
        "INSERT INTO sequences (seq_id, params, prompt, state, cursor, "
        "prefilled_tokens, num_generated, num_generated_at_admission, "
        "finish_reason, finish_order) VALUES (?, ?, ?, 4, 64, 64, 32, 0, 2, ?)",
        [(i, PARAMS, prompt, i) for i in range(1, num_sequences + 1)],
    )
    db.executemany(
        "INSERT INTO outputs (seq_id, token_ids) VALUES (?, ?)",
        [(i, output) for i in range(1, num_sequences + 1)],
    )
    db.execute("COMMIT")
    store.close()
    started = time.perf_counter()
    store = SqliteStateStore(state_dir)
    opened = time.perf_counter() - started
    started = time.perf_counter()
    store.load()
    loaded = time.perf_counter() - started
    rows = store.num_rows_verified
    store.close()
    return rows, opened, loaded


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.state_integrity", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rows", type=int, default=256, help="rows written per round")
    parser.add_argument("--rounds", type=int, default=200, help="timed rounds per row")
    parser.add_argument(
        "--verify-sequences",
        type=int,
        default=20000,
        help="finished sequences in the store whose start is timed",
    )
    parser.add_argument("--tmp-dir", default=None, help="where the databases go")
    args = parser.parse_args()
    print(f"{args.rows} rows per round, {args.rounds} rounds, medians")
    print(f"{'checksums':<10} {'progress rows':>16} {'per row':>9} {'token_log row':>15}")
    for checksums in (False, True):
        with tempfile.TemporaryDirectory(dir=args.tmp_dir) as directory:
            db = _database(directory, checksums, args.rows)
            progress, log = _write_rounds(db, args.rows, args.rounds)
            db.close()
        print(
            f"{'on' if checksums else 'off':<10} {progress:>13.0f} us {progress / args.rows:>6.1f} us"
            f" {log:>12.0f} us"
        )
    with tempfile.TemporaryDirectory(dir=args.tmp_dir) as directory:
        rows, opened, loaded = _verify_figures(directory, args.verify_sequences)
    print(
        f"start on {args.verify_sequences} finished sequences: {rows} rows verified while "
        f"opening in {opened * 1000:.0f} ms; loading them took {loaded * 1000:.0f} ms more"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
