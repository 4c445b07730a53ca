"""Workloads: requests (arrival time, prompt and output length) from a trace and a rate.

A trace is a CSV with one request per row: `num_prefill_tokens`, `num_decode_tokens` and,
optionally, `arrived_at` in seconds (Vidur's format); or a Mooncake JSONL file (.jsonl or
.jsonl.gz, mooncake.py), whose rows also carry their prompt's block hash ids, so that
prompts share prefixes as the trace's did (`prompt_token_ids`). Shipped traces are named
by their file stem (see data/traces/NOTICE.md); any other path works too.
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from service.sim import mooncake

ARRIVALS = ("poisson", "trace")
# Token ids of simulated prompts: a trace block's first token is FIRST_BLOCK_TOKEN + its
# hash id and the rest FILLER_TOKEN, so that two prompts share a prefix exactly where
# their hash ids agree (the chained block hash does the rest). A request of a trace
# without hash ids starts with a token of its own (no two share a prefix).
FILLER_TOKEN = 2
FIRST_BLOCK_TOKEN = 3
FIRST_UNIQUE_TOKEN = 1 << 30


class WorkloadError(ValueError):
    """A trace or workload setting that cannot be used; the message says why."""


@dataclass(frozen=True)
class TraceRow:
    prompt_len: int
    output_len: int
    arrived_at: float | None
    hash_ids: tuple[int, ...] = ()  # the prompt's trace blocks (Mooncake); () for a CSV


@dataclass(frozen=True)
class Trace:
    name: str
    rows: tuple[TraceRow, ...]
    block_tokens: int = 0  # tokens per trace block (of hash_ids); 0: no blocks (a CSV)

    @property
    def has_arrivals(self) -> bool:
        return self.rows[0].arrived_at is not None

    @property
    def has_prefixes(self) -> bool:
        """Whether prompts share prefixes (the rows carry block hash ids)."""
        return self.block_tokens > 0


@dataclass(frozen=True)
class Request:
    """One simulated request; prompt_len + output_len <= max_seq_len."""

    index: int
    arrival_seconds: float
    prompt_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()  # trace blocks of block_tokens tokens, see prompt_token_ids
    block_tokens: int = 0


def prompt_token_ids(request: Request) -> tuple[int, ...]:
    """The request's prompt: its trace blocks' tokens (see FIRST_BLOCK_TOKEN), cut to
    prompt_len; deterministic, so the real block hashes, reports and lookups run on it."""
    n = request.prompt_len
    if not request.hash_ids:
        return (FIRST_UNIQUE_TOKEN + request.index,) + (FILLER_TOKEN,) * (n - 1)
    num_blocks = -(-n // request.block_tokens)
    if len(request.hash_ids) < num_blocks:
        raise WorkloadError(
            f"request {request.index}: {n} prompt tokens need {num_blocks} "
            f"blocks of {request.block_tokens}, it has "
            f"{len(request.hash_ids)} hash ids"
        )
    filler = (FILLER_TOKEN,) * (request.block_tokens - 1)
    tokens: list[int] = []
    for block_id in request.hash_ids[:num_blocks]:
        tokens.append(FIRST_BLOCK_TOKEN + block_id)
        tokens.extend(filler)
    return tuple(tokens[:n])


_SUFFIXES = (".csv", ".jsonl.gz", ".jsonl")


def shipped_traces() -> list[str]:
    folder = resources.files(__package__) / "data" / "traces"
    return sorted(
        p.name[: -len(suffix)]
        for p in folder.iterdir()
        for suffix in _SUFFIXES
        if p.name.endswith(suffix)
    )


def load_trace(name_or_path: str, *, block_tokens: int = mooncake.TRACE_BLOCK_TOKENS) -> Trace:
    """A shipped trace by name, or a CSV or Mooncake JSONL file by path; a Mooncake trace's
    prompts are scaled to `block_tokens` tokens a trace block (mooncake.py)."""
    path = Path(name_or_path)
    if not path.is_file():
        folder = resources.files(__package__) / "data" / "traces"
        shipped = [folder / f"{name_or_path}{suffix}" for suffix in _SUFFIXES]
        shipped = [p for p in shipped if p.is_file()]
        if not shipped:
            raise WorkloadError(
                f"--trace {name_or_path}: neither a file nor a shipped trace "
                f"({', '.join(shipped_traces())})"
            )
        path = Path(str(shipped[0]))
    if mooncake.is_mooncake(path):
        rows = tuple(
            TraceRow(*row) for row in mooncake.read_rows(path, block_tokens, WorkloadError)
        )
        if not rows:
            raise WorkloadError(f"{path}: no requests")
        name = path.name.removesuffix(".gz").removesuffix(".jsonl")
        return Trace(name, rows, block_tokens)
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
                row = TraceRow(
                    int(float(raw["num_prefill_tokens"])),
                    int(float(raw["num_decode_tokens"])),
                    float(raw["arrived_at"]) if has_arrivals else None,
                )
            except (TypeError, ValueError):
                raise WorkloadError(f"{path}:{line}: not a number in {raw}") from None
            if row.prompt_len < 1 or row.output_len < 1:
                raise WorkloadError(f"{path}:{line}: prompt and output need at least 1 token")
            rows.append(row)
    if not rows:
        raise WorkloadError(f"{path}: no requests")
    return Trace(path.stem, tuple(rows))


def make_requests(
    trace: Trace, *, num_requests: int, qps: float, arrivals: str, seed: int, max_seq_len: int
) -> list[Request]:
    """`num_requests` requests arriving at `qps` on average; the same seed, the same list.

    - poisson: exponential gaps at rate qps; lengths drawn from the trace's rows
      (without replacement while rows last), or, for a trace whose prompts share
      prefixes, its rows in order (a conversation's turns keep their order);
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
        rows = (
            _rows_in_order(trace.rows, num_requests)
            if trace.has_prefixes
            else _draw_rows(trace.rows, num_requests, rng)
        )
        times, t = [], 0.0
        for _ in rows:
            t += rng.expovariate(qps)
            times.append(t)
    elif arrivals == "trace":
        if not trace.has_arrivals:
            raise WorkloadError(
                f"trace {trace.name} has no arrived_at column; use --arrivals poisson"
            )
        rows, times = _trace_arrivals(trace.rows, num_requests, qps)
    else:
        raise WorkloadError(f"--arrivals must be one of {', '.join(ARRIVALS)}, got {arrivals!r}")
    out = []
    for index, (row, arrival) in enumerate(zip(rows, times)):
        prompt_len = min(row.prompt_len, max_seq_len - 1)
        output_len = min(row.output_len, max_seq_len - prompt_len)
        out.append(
            Request(index, arrival, prompt_len, output_len, row.hash_ids, trace.block_tokens)
        )
    return out


def _rows_in_order(rows: tuple[TraceRow, ...], count: int) -> list[TraceRow]:
    return [rows[i % len(rows)] for i in range(count)]


def _draw_rows(rows: tuple[TraceRow, ...], count: int, rng: random.Random) -> list[TraceRow]:
    drawn: list[TraceRow] = []
    while len(drawn) < count:
        drawn.extend(rng.sample(rows, min(len(rows), count - len(drawn))))
    return drawn


def _trace_arrivals(
    rows: tuple[TraceRow, ...], count: int, qps: float
) -> tuple[list[TraceRow], list[float]]:
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
