"""What a simulation prints and writes: terminal tables, the JSON file, the comparison plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from service.sim.metrics import RunResult

# (header, key, scale, format): times in seconds unless the header says ms.
_COLUMNS = (
    ("policy", "policy", None, "{}"),
    ("routing", "routing", None, "{}"),
    ("QPS", "qps", None, "{:.3g}"),
    ("TTFT p50 s", "ttft_p50", 1, "{:.3f}"),
    ("p90", "ttft_p90", 1, "{:.3f}"),
    ("p99", "ttft_p99", 1, "{:.3f}"),
    ("TPOT p50 ms", "tpot_p50", 1000, "{:.1f}"),
    ("p90", "tpot_p90", 1000, "{:.1f}"),
    ("p99", "tpot_p99", 1000, "{:.1f}"),
    ("E2E p50 s", "e2e_p50", 1, "{:.2f}"),
    ("p99", "e2e_p99", 1, "{:.2f}"),
    ("queue p50 s", "queue_p50", 1, "{:.3f}"),
    ("p99", "queue_p99", 1, "{:.3f}"),
    ("out tok/s", "output_tokens_per_s", 1, "{:.0f}"),
    ("preempt", "preemptions", None, "{}"),
    ("makespan s", "makespan", 1, "{:.1f}"),
    ("hit rate", "prefix_hit_rate", 1, "{:.3f}"),
    ("misses", "cache_misses", None, "{}"),
    ("max share/mean", "max_share_over_mean", 1, "{:.2f}"),
)


def results_table(results: Sequence[RunResult]) -> str:
    """One row per run, the figures of the JSON output (times in s, TPOT in ms)."""
    rows = [[header for header, *_ in _COLUMNS]]
    for result in results:
        values = result.to_json()
        row = []
        for _, key, scale, fmt in _COLUMNS:
            value = values[key]
            row.append(fmt.format(value * scale if scale else value))
        rows.append(row)
    return format_table(rows)


def format_table(rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell: text left-aligned, the rest right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    numeric = [all(_is_number(row[i]) for row in rows[1:]) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        cells = [
            cell.rjust(w) if num else cell.ljust(w) for cell, w, num in zip(row, widths, numeric)
        ]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str | Path, objects: Sequence[dict]) -> None:
    """One object per run, in a JSON array."""
    Path(path).write_text(json.dumps(list(objects), indent=1) + "\n")


def plot_comparison(
    path: str | Path,
    results: Sequence[RunResult],
    *,
    slo_ttft_p99: float | None = None,
    slo_tpot_p99: float | None = None,
    title: str = "",
) -> None:
    """TTFT p99 and TPOT p99 against QPS, one line per policy (and routing), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[str, list[RunResult]] = {}
    for result in results:
        label = result.policy if result.routing == "pull" else f"{result.policy} ({result.routing})"
        lines.setdefault(label, []).append(result)
    fig, (ax_ttft, ax_tpot) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, runs in lines.items():
        runs = sorted(runs, key=lambda r: r.qps)
        qps = [r.qps for r in runs]
        ax_ttft.plot(qps, [r.ttft_p99 for r in runs], marker="o", label=label)
        ax_tpot.plot(qps, [r.tpot_p99 * 1000 for r in runs], marker="o", label=label)
    if slo_ttft_p99:
        ax_ttft.axhline(slo_ttft_p99, color="grey", linestyle="--", label="SLO")
    if slo_tpot_p99:
        ax_tpot.axhline(slo_tpot_p99 * 1000, color="grey", linestyle="--", label="SLO")
    ax_ttft.set(xlabel="QPS", ylabel="TTFT p99 (s)", title="Time to first token, p99")
    ax_tpot.set(xlabel="QPS", ylabel="TPOT p99 (ms)", title="Time per output token, p99")
    for ax in (ax_ttft, ax_tpot):
        ax.grid(True, alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
