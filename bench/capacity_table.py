"""The capacity table of docs/simulation.md: capacity of the default settings, of the two latency
targets and of a search over fixed token budgets, per trace and worker count, with the
same runs (`lattice-scheduler simulate --find-capacity`, one process per search).

    .venv/bin/python -m bench.capacity_table --num-requests 2000 --jobs 2

Prints one Markdown row per cell: each configuration's capacity (QPS) and saturation
rate (requests/s), the best fixed budget and whether the targets reach it. The default
settings' budget is the contract's 2,048, so the fixed budgets searched are those below. Every search
of a cell starts at the same --qps, so all of them probe the same grid of rates; the
simulator's figures are virtual time and do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.harness.tables import markdown_table

TRACES = ("splitwise_conv", "splitwise_code", "sharegpt")
BUDGETS = (384, 512, 768)
TARGETS = ("--tpot-target-ms", "100", "--ttft-target-ms", "2000")
SLO = ("--slo-ttft-p99", "2", "--slo-tpot-p99", "0.1")


def main() -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.capacity_table", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--traces", default=",".join(TRACES))
    p.add_argument("--workers", default="4,1", help="worker counts, comma-separated")
    p.add_argument(
        "--budgets",
        default=",".join(map(str, BUDGETS)),
        help="fixed --max-num-batched-tokens to search (default %(default)s)",
    )
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=2, help="searches run at once")
    p.add_argument(
        "--extra", default="", help="more simulate flags for every run (e.g. Vidur's worker shape)"
    )
    p.add_argument(
        "--configs",
        help="only these, comma-separated: default, targets, fixed B (e.g. 'targets,fixed 512')",
    )
    p.add_argument("--capacity-tolerance", default="0.05")
    p.add_argument(
        "--json",
        metavar="FILE",
        help="append each search's summary to this file as it finishes (JSON lines)",
    )
    p.add_argument(
        "--from-json",
        metavar="FILE[,FILE]",
        help="run nothing: print the table of these JSON-lines summaries (a "
        "later line's search replaces an earlier one's)",
    )
    args = p.parse_args()

    budgets = [int(b) for b in args.budgets.split(",") if b]
    cells = [(trace, int(w)) for w in args.workers.split(",") for trace in args.traces.split(",")]
    configs = [("default", ()), ("targets", TARGETS)] + [
        (f"fixed {b}", ("--max-num-batched-tokens", str(b))) for b in budgets
    ]
    if args.from_json:
        found = [
            json.loads(line)
            for path in args.from_json.split(",")
            for line in Path(path).read_text().splitlines()
            if line.strip()
        ]
        _print_table(found, cells, [name for name, _ in configs])
        return 0
    wanted = set(args.configs.split(",")) if args.configs else {name for name, _ in configs}
    jobs = [
        (trace, workers, name, flags)
        for trace, workers in cells
        for name, flags in configs
        if name in wanted
    ]
    with tempfile.TemporaryDirectory() as out, ThreadPoolExecutor(args.jobs) as pool:
        found = list(pool.map(lambda job: _search(job, args, Path(out)), jobs))
    _print_table(found, cells, [name for name, _ in configs])
    return 0


def _search(job, args, out: Path) -> dict:
    trace, workers, name, flags = job
    start = "2" if workers == 1 else "8"
    path = out / f"{trace}-{workers}-{name.replace(' ', '_')}.json"
    command = [
        sys.executable,
        "-m",
        "service.cli.main",
        "simulate",
        "--find-capacity",
        *SLO,
        "--trace",
        trace,
        "--workers",
        str(workers),
        "--num-requests",
        str(args.num_requests),
        "--seed",
        str(args.seed),
        "--qps",
        start,
        "--no-progress",
        "--capacity-tolerance",
        args.capacity_tolerance,
        *flags,
        *args.extra.split(),
        "--json",
        str(path),
    ]
    done = subprocess.run(
        ["nice", "-n", "10", *command],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)}: exit {done.returncode}\n{done.stderr}")
    runs = json.loads(path.read_text())
    capacity = runs[0]["capacity_qps"]
    at = [r for r in runs if r["qps"] == capacity]
    summary = {
        "trace": trace,
        "workers": workers,
        "config": name,
        "flags": list(flags),
        "capacity_qps": capacity,
        "probes": len(runs),
        "saturation_requests_per_s": runs[0]["saturation_requests_per_s"],
        "ttft_p99_s": at[0]["ttft_p99"] if at else None,
        "tpot_p99_s": at[0]["tpot_p99"] if at else None,
    }
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(summary) + "\n")
    print(
        f"{trace} {workers}w {name}: {capacity:.3f} QPS "
        f"(saturation {summary['saturation_requests_per_s']:.2f})",
        file=sys.stderr,
        flush=True,
    )
    return summary


def _print_table(found: list[dict], cells, names: list[str]) -> None:
    by = {(f["trace"], f["workers"], f["config"]): f for f in found}
    rows = []
    for trace, workers in cells:
        row = [by.get((trace, workers, name)) for name in names]
        fixed = [f for f in row if f and f["config"].startswith("fixed")]
        best = max(fixed, key=lambda f: f["capacity_qps"]) if fixed else None
        targets = by.get((trace, workers, "targets"))
        cells_text = [
            f"{f['capacity_qps']:.2f} ({f['saturation_requests_per_s']:.2f})" if f else "-"
            for f in row
        ]
        best_text = f"{best['config'][6:]}: {best['capacity_qps']:.2f}" if best else "-"
        ratio = (
            f"{targets['capacity_qps'] / best['capacity_qps']:.2f}x"
            if targets and best and best["capacity_qps"]
            else "-"
        )
        rows.append([trace, workers, *cells_text, best_text, ratio])
    print(markdown_table(["trace", "workers", *names, "best fixed", "targets / best"], rows))


if __name__ == "__main__":
    sys.exit(main())
