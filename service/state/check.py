"""`lattice-scheduler state check DIR`: verify a state directory offline.

The check opens a copy of the directory's files with the same code a starting scheduler
runs (marker, checksums of every row, decoding of every row, the token log's order), so
"sound" here means a scheduler would start on it, and nothing in DIR is changed. A
directory in use by a running scheduler is not checked (its files change under the copy).
"""

from __future__ import annotations

import fcntl
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from service.core import SequenceState
from service.state.integrity import StateDamaged, marker_path
from service.state.sqlite import DB_NAME, SqliteStateStore


class CannotCheck(Exception):
    """DIR is not a state directory, or is in use: nothing was checked."""


@dataclass(frozen=True)
class CheckReport:
    """What a sound state directory holds."""

    directory: Path
    num_rows_verified: int
    states: dict[SequenceState, int]
    num_workers: int
    num_tokens: int
    next_seq_id: int
    last_incarnation: int

    def line(self) -> str:
        counts = ", ".join(
            f"{n} {s.name.lower()}"
            for s, n in sorted(self.states.items(), key=lambda item: item[0].value)
        )
        num_sequences = sum(self.states.values())
        return (
            f"{self.directory}: sound: {self.num_rows_verified} rows verified; "
            f"{num_sequences} sequences ({counts or 'none'}), {self.num_tokens} generated "
            f"tokens, {self.num_workers} workers registered, next seq_id "
            f"{self.next_seq_id}, last incarnation {self.last_incarnation}"
        )


def check(directory: str | Path) -> CheckReport:
    """Verify `directory`; StateDamaged (naming DIR's own file) when a scheduler would
    refuse it, CannotCheck when it cannot be checked."""
    directory = Path(directory)
    db_path = directory / DB_NAME
    if not directory.is_dir():
        raise CannotCheck(f"{directory}: no such directory")
    if not db_path.exists() and not marker_path(db_path).exists():
        raise CannotCheck(f"{directory}: not a state directory (no {DB_NAME})")
    with _unused(directory), tempfile.TemporaryDirectory(prefix="state-check-") as scratch:
        for name in (DB_NAME, DB_NAME + "-wal", marker_path(db_path).name):
            if (directory / name).exists():
                shutil.copyfile(directory / name, Path(scratch) / name)
        try:
            store = SqliteStateStore(scratch)
            try:
                state = store.load()
            finally:
                store.close()
        except StateDamaged as err:
            # The copy's messages name the copy: name the directory that was asked about.
            raise StateDamaged(str(err).replace(scratch, str(directory))) from None
        return CheckReport(
            directory=directory,
            num_rows_verified=store.num_rows_verified,
            states=dict(Counter(s.progress.state for s in state.sequences)),
            num_workers=len(state.workers),
            num_tokens=sum(len(s.output_token_ids) for s in state.sequences),
            next_seq_id=state.next_seq_id,
            last_incarnation=state.last_incarnation,
        )


class _unused:
    """Hold DIR's lock while copying, so that no scheduler writes meanwhile."""

    def __init__(self, directory: Path) -> None:
        self._path = directory / "lock"
        self._file = None

    def __enter__(self) -> None:
        if not self._path.exists():
            return  # never served from: nobody to keep out
        self._file = open(self._path)  # closed in __exit__
        try:
            fcntl.flock(self._file, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise CannotCheck(
                f"{self._path.parent}: in use by a running scheduler; stop it "
                "first, or check a copy (docs/operations.md, Back-up)"
            ) from None

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            self._file.close()
