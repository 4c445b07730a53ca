"""Step-time tables: what `lattice-worker profile` measures and the simulator reads.

A table holds the measured wall time of one `Engine.step` on a grid of
(prefill tokens, decode batch, context length), each grid step being one prefill chunk
of P tokens whose first C prompt tokens are already cached, together with D decoding
sequences that each hold C tokens. Between and beyond grid points the time is
interpolated monotonically (common.interp).

A real step may mix several chunks and decodes of different lengths; `StepLoad` is that
step, and `StepTableModel.step_seconds` maps it onto the grid:
- P = all prefill tokens of the step, D = its decodes;
- C = the mean context over the step's token rows (a chunk's rows count its cached tokens,
  a decode's row its sequence's cached tokens);
- every chunk past the first adds `extra_chunk_seconds` (measured: an engine that runs
  one forward per chunk pays a forward's fixed cost for each; one that packs chunks
  into one forward pays next to nothing).

The file is JSON (`FORMAT`), written by `save` and read by `load`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from common.interp import MonotoneGrid
from common.loadgen import percentile

FORMAT = "lattice-step-table/1"


@dataclass(frozen=True)
class StepLoad:
    """The work of one engine step, as cost models see it."""

    # (tokens in the chunk, prompt tokens already cached before it), one per chunk.
    prefill_chunks: tuple[tuple[int, int], ...] = ()
    # Tokens already cached for each decoding sequence (the new token not counted).
    decode_context_lens: tuple[int, ...] = ()

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for n, _ in self.prefill_chunks)

    @property
    def num_decodes(self) -> int:
        return len(self.decode_context_lens)

    def mean_context_len(self) -> float:
        """Mean cached tokens over the step's token rows (0 for an empty step)."""
        rows = self.num_prefill_tokens + self.num_decodes
        if rows == 0:
            return 0.0
        cached = sum(n * c for n, c in self.prefill_chunks) + sum(self.decode_context_lens)
        return cached / rows


@dataclass(frozen=True)
class HeldOutPoint:
    """A step timed apart from the grid, to check the table's predictions."""

    load: StepLoad
    measured_seconds: float
    predicted_seconds: float

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_seconds - self.measured_seconds) / self.measured_seconds


@dataclass(frozen=True)
class StepTable:
    """Measured step times on the grid prefill_tokens x decode_batch x context_len."""

    prefill_tokens: tuple[int, ...]
    decode_batch: tuple[int, ...]
    context_len: tuple[int, ...]
    # seconds[i][j][k]: the time (best of the repeats) of a step with prefill_tokens[i]
    # tokens in one chunk and decode_batch[j] decodes, each at context_len[k] cached tokens.
    seconds: tuple[tuple[tuple[float, ...], ...], ...]
    extra_chunk_seconds: float = 0.0
    # What was measured, with what (model, device, dtype, torch version, repeats) and the
    # engine's pools (page_size, total_kv_pages, total_gdn_slots): defaults for a simulator.
    meta: dict = field(default_factory=dict)
    held_out: tuple[HeldOutPoint, ...] = ()

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "meta": self.meta,
            "prefill_tokens": list(self.prefill_tokens),
            "decode_batch": list(self.decode_batch),
            "context_len": list(self.context_len),
            "seconds": [[list(row) for row in plane] for plane in self.seconds],
            "extra_chunk_seconds": self.extra_chunk_seconds,
            "held_out": [
                {
                    "prefill_chunks": [list(c) for c in p.load.prefill_chunks],
                    "decode_context_lens": list(p.load.decode_context_lens),
                    "measured_seconds": p.measured_seconds,
                    "predicted_seconds": p.predicted_seconds,
                }
                for p in self.held_out
            ],
        }

    @classmethod
    def from_json(cls, raw: dict) -> StepTable:
        if raw.get("format") != FORMAT:
            raise ValueError(
                f"not a step table: format is {raw.get('format')!r}, expected {FORMAT!r}"
            )
        try:
            table = cls(
                prefill_tokens=tuple(int(x) for x in raw["prefill_tokens"]),
                decode_batch=tuple(int(x) for x in raw["decode_batch"]),
                context_len=tuple(int(x) for x in raw["context_len"]),
                seconds=tuple(
                    tuple(tuple(float(v) for v in row) for row in plane) for plane in raw["seconds"]
                ),
                extra_chunk_seconds=float(raw.get("extra_chunk_seconds", 0.0)),
                meta=dict(raw.get("meta", {})),
                held_out=tuple(
                    HeldOutPoint(
                        StepLoad(
                            tuple((int(n), int(c)) for n, c in p["prefill_chunks"]),
                            tuple(int(c) for c in p["decode_context_lens"]),
                        ),
                        float(p["measured_seconds"]),
                        float(p["predicted_seconds"]),
                    )
                    for p in raw.get("held_out", ())
                ),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"malformed step table: {err}") from None
        shape = (len(table.prefill_tokens), len(table.decode_batch), len(table.context_len))
        got = (
            len(table.seconds),
            len(table.seconds[0]) if table.seconds else 0,
            len(table.seconds[0][0]) if table.seconds and table.seconds[0] else 0,
        )
        if got != shape or any(
            len(plane) != shape[1] or any(len(r) != shape[2] for r in plane)
            for plane in table.seconds
        ):
            raise ValueError(
                f"malformed step table: seconds must be {shape[0]} x {shape[1]} x "
                f"{shape[2]} (prefill_tokens x decode_batch x context_len)"
            )
        return table


def save(table: StepTable, path: str | Path) -> None:
    Path(path).write_text(json.dumps(table.to_json(), indent=1) + "\n")


def load(path: str | Path) -> StepTable:
    """Read a table; ValueError (with the path) if it is missing or malformed."""
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON: {err}") from None
    try:
        return StepTable.from_json(raw)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


class StepTableModel:
    """Step time from a StepTable (see the module docstring for the mapping)."""

    def __init__(self, table: StepTable) -> None:
        self.table = table
        self._grid = MonotoneGrid(
            [table.prefill_tokens, table.decode_batch, table.context_len], table.seconds
        )
        self._extra_chunk_seconds = max(0.0, table.extra_chunk_seconds)

    def step_seconds(self, load: StepLoad) -> float:
        rows = load.num_prefill_tokens + load.num_decodes
        if rows == 0:
            return 0.0
        seconds = self._grid(load.num_prefill_tokens, load.num_decodes, load.mean_context_len())
        return seconds + max(0, len(load.prefill_chunks) - 1) * self._extra_chunk_seconds


def summarize_errors(points: Sequence[HeldOutPoint]) -> dict[str, float]:
    """Median and 90th percentile of |relative error|, and the mean signed error."""
    if not points:
        return {}
    errors = sorted(abs(p.error) for p in points)
    return {
        "num_points": len(points),
        "median_abs_error": percentile(errors, 50),
        "p90_abs_error": percentile(errors, 90),
        "max_abs_error": errors[-1],
        "mean_error": sum(p.error for p in points) / len(points),
    }


__all__ = [
    "FORMAT",
    "HeldOutPoint",
    "StepLoad",
    "StepTable",
    "StepTableModel",
    "load",
    "save",
    "summarize_errors",
]
