"""A worker's timeline, one JSON line per decision and per engine step (`--step-log`).

For finding where a request's time went: when the worker asked for a decision and when
it came, when each step ran, which prompt chunks it carried and which sequences got
their first token in it. Times are wall-clock seconds (`time.time()`), so that lines of
several workers and of a load generator on one host line up.

    {"event": "decision", "worker": W, "asked": t, "answered": t, "iteration": n,
     "admitted": [seq_id, ...], "num_chunks": c, "num_decodes": d}
    {"event": "step", "worker": W, "started": t, "ended": t,
     "chunks": [[seq_id, chunk_start, chunk_len, cached_tokens], ...],
     "num_decodes": d, "first_tokens": [seq_id, ...]}

With the overlap, the decision a step runs is the one answered before it started (the
step before's report); a step's lines follow its decision's.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from worker_client.convert import Work
from worker_client.engine.api import StepOutput


class StepLog:
    """Appends the lines to `path` (line-buffered: a killed worker loses at most one)."""

    def __init__(self, path: Path | str, worker_id: str) -> None:
        self._file = open(path, "a", buffering=1)
        self._worker_id = worker_id
        self._lock = threading.Lock()

    def decision(self, asked: float, answered: float, iteration: int, work: Work) -> None:
        self._write(
            event="decision",
            asked=round(asked, 6),
            answered=round(answered, 6),
            iteration=iteration,
            admitted=list(work.admitted),
            num_chunks=len(work.prefill),
            num_decodes=len(work.decode),
        )

    def step(self, started: float, ended: float, work: Work, out: StepOutput) -> None:
        prefilled = {c.seq_id for c in work.prefill}
        self._write(
            event="step",
            started=round(started, 6),
            ended=round(ended, 6),
            chunks=[[c.seq_id, c.chunk_start, c.chunk_len, c.cached_tokens] for c in work.prefill],
            num_decodes=len(work.decode),
            first_tokens=[
                seq_id for seq_id, tokens in out.tokens if seq_id in prefilled and tokens
            ],
        )

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def _write(self, **fields) -> None:
        line = json.dumps({"worker": self._worker_id, **fields}, separators=(",", ":"))
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")


def read(path: Path | str) -> list[dict]:
    """The lines of a step log, in file order (a torn last line is skipped)."""
    lines = []
    for text in Path(path).read_text().splitlines():
        try:
            lines.append(json.loads(text))
        except json.JSONDecodeError:
            continue
    return lines
