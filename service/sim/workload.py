"""Workloads: requests (arrival time, prompt and output length) from a trace and a rate.

A trace is a CSV with one request per row: `num_prefill_tokens`, `num_decode_tokens` and,
optionally, `arrived_at` in seconds (Vidur's format). Shipped traces are named by their
file stem (see data/traces/NOTICE.md); any other path works too.
"""
from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

ARRIVALS = ("poisson", "trace")


class WorkloadError(ValueError):
    """A trace or workload setting that cannot be used; the message says why."""


@dataclass(frozen=True)
class TraceRow:
    prompt_len: int
    output_len: int
    arrived_at: float | None


@dataclass(frozen=True)
class Trace:
    name: str
    rows: tuple[TraceRow, ...]

    @property
    def has_arrivals(self) -> bool:
        return self.rows[0].arrived_at is not None


@dataclass(frozen=True)
class Request:
    """One simulated request; prompt_len + output_len <= max_seq_len."""

    index: int
    arrival_seconds: float
    prompt_len: int
    output_len: int


def shipped_traces() -> list[str]:
    folder = resources.files(__package__) / "data" / "traces"
    return sorted(p.name[:-4] for p in folder.iterdir() if p.name.endswith(".csv"))


def load_trace(name_or_path: str) -> Trace:
    """A shipped trace by name, or a CSV file by path."""
    path = Path(name_or_path)
    if not path.is_file():
        shipped = resources.files(__package__) / "data" / "traces" / f"{name_or_path}.csv"
        if not shipped.is_file():
            raise WorkloadError(f"--trace {name_or_path}: neither a file nor a shipped trace "
                                f"({', '.join(shipped_traces())})")
        path = Path(str(shipped))
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        columns = set(reader.fieldnames or ())
        missing = {"num_prefill_tokens", "num_decode_tokens"} - columns
        if missing:
            raise WorkloadError(f"{path}: missing the columns {', '.join(sorted(missing))}")
        has_arrivals = "arrived_at" in columns
        rows = []
        for line, raw in enumerate(reader, start=2):
            try:
                row = TraceRow(int(float(raw["num_prefill_tokens"])),
                               int(float(raw["num_decode_tokens"])),
                               float(raw["arrived_at"]) if has_arrivals else None)
            except (TypeError, ValueError):
                raise WorkloadError(f"{path}:{line}: not a number in {raw}") from None
            if row.prompt_len < 1 or row.output_len < 1:
                raise WorkloadError(f"{path}:{line}: prompt and output need at least 1 token")
            rows.append(row)
    if not rows:
        raise WorkloadError(f"{path}: no requests")
    return Trace(path.stem, tuple(rows))


def make_requests(trace: Trace, *, num_requests: int, qps: float, arrivals: str, seed: int,
                  max_seq_len: int) -> list[Request]:
    """`num_requests` requests arriving at `qps` on average; the same seed, the same list.

    - poisson: exponential gaps at rate qps; lengths drawn from the trace's rows
      (without replacement while rows last);
    - trace: the trace's rows in order with their own gaps scaled so that the mean rate is
      qps (past the trace's end it starts over, after one mean gap).
    Each request's prompt is capped at max_seq_len - 1 tokens and its output at what is
    left, so that prompt + output <= max_seq_len.
    """
    if num_requests < 1:
        raise WorkloadError(f"--num-requests must be at least 1, got {num_requests}")
    if not qps > 0:
        raise WorkloadError(f"--qps must be above 0, got {qps}")
    if max_seq_len < 2:
        raise WorkloadError(f"max_seq_len must be at least 2, got {max_seq_len}")
    rng = random.Random(seed)
    if arrivals == "poisson":
        rows = _draw_rows(trace.rows, num_requests, rng)
        times, t = [], 0.0
        for _ in rows:
            t += rng.expovariate(qps)
            times.append(t)
    elif arrivals == "trace":
        if not trace.has_arrivals:
            raise WorkloadError(f"trace {trace.name} has no arrived_at column; "
                                f"use --arrivals poisson")
        rows, times = _trace_arrivals(trace.rows, num_requests, qps)
    else:
        raise WorkloadError(f"--arrivals must be one of {', '.join(ARRIVALS)}, got {arrivals!r}")
    out = []
    for index, (row, arrival) in enumerate(zip(rows, times)):
        prompt_len = min(row.prompt_len, max_seq_len - 1)
        output_len = min(row.output_len, max_seq_len - prompt_len)
        out.append(Request(index, arrival, prompt_len, output_len))
    return out


def _draw_rows(rows: tuple[TraceRow, ...], count: int, rng: random.Random) -> list[TraceRow]:
    drawn: list[TraceRow] = []
    while len(drawn) < count:
        drawn.extend(rng.sample(rows, min(len(rows), count - len(drawn))))
    return drawn


def _trace_arrivals(rows: tuple[TraceRow, ...], count: int,
                    qps: float) -> tuple[list[TraceRow], list[float]]:
    first = rows[0].arrived_at
    span = rows[-1].arrived_at - first
    mean_gap = span / (len(rows) - 1) if len(rows) > 1 and span > 0 else 1.0
    scale = (1.0 / qps) / mean_gap  # trace seconds -> simulated seconds
    picked, times = [], []
    for i in range(count):
        lap, row = divmod(i, len(rows))
        picked.append(rows[row])
        times.append((lap * (span + mean_gap) + rows[row].arrived_at - first) * scale)
    return picked, times
