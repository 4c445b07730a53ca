"""Figures printed side by side: aligned columns for a terminal, markdown for the docs."""

from __future__ import annotations

import os
from collections.abc import Sequence

from common.loadgen import percentile


def print_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Columns as wide as their widest cell: the first left-aligned (the row's name), the
    others right-aligned (figures)."""
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    for row in [header, *rows]:
        print(
            "  ".join(
                str(x).rjust(w) if i else str(x).ljust(w)
                for i, (x, w) in enumerate(zip(row, widths))
            )
        )


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """The table as markdown, to paste into docs/benchmarks.md."""
    lines = [
        "| " + " | ".join(map(str, header)) + " |",
        "| " + " | ".join("---" for _ in header) + " |",
    ]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)


def pct(values: Sequence[float], percent: float) -> float:
    """Nearest-rank percentile of values in any order."""
    return percentile(sorted(values), percent)


def ms(seconds: float, digits: int = 2) -> str:
    return f"{seconds * 1000:.{digits}f}"


def load_note() -> str:
    """The machine's cores and load now, for a run's heading: read ratios within one run."""
    one, five, _ = os.getloadavg()
    return f"({os.cpu_count()} cores, load average {one:.1f} / {five:.1f} over 1 / 5 min)"
