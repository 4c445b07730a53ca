"""Placement's regression table (docs/policies.md, "Placement: the regression
table"): prefix caching on against off, and pull against a peer's router,
on both Mooncake traces, per setting, at 1 and 2 QPS and at 80% of the capacity with
caching off, plus the capacity with caching on and off; with the load balance column.

    .venv/bin/python -m bench.placement_regression            # the whole table
    .venv/bin/python -m bench.placement_regression --settings conv-128-budget --num-requests 1000
    .venv/bin/python -m bench.placement_regression --num-requests 1000 --cache DIR  # resumable

Runs the simulator in this process (`lattice-scheduler simulate`'s own pieces: the same
Setup, config resolution and runs), 4 workers, A30 profile, seed 0, Poisson arrivals,
one run per cell. A setting is a trace, its --block-tokens (the scale of its prompts),
a --max-seq-len and the policy's budget: fixed 512 tokens or the latency targets
(--tpot-target-ms 100 --ttft-target-ms 2000). The capacity is at TTFT p99 <= 2 s and
TPOT p99 <= 100 ms, bisected to --capacity-tolerance. Progress goes to stderr, the
Markdown table to stdout.

With --cache DIR every run (a cell or a capacity probe) is kept in DIR as one JSON file,
with the commit it ran on, and read back instead of run again: a table cut short resumes
where it stopped, and settings run in separate processes come together in one table
(`--from-cache` prints it from DIR alone, leaving out what is not there). The cache is
keyed by the run's parameters, not by the code: empty DIR after changing the rule.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench.harness.tables import markdown_table
from common.loadgen import percentile

TARGETS = ("--tpot-target-ms", "100", "--ttft-target-ms", "2000")
BUDGET_512 = ("--policy", "budget", "--max-num-batched-tokens", "512")


def _slo():
    from service.sim.experiments import Slo

    return Slo(ttft_p99=2.0, tpot_p99=0.1)


@dataclass(frozen=True)
class Setting:
    name: str
    trace: str
    flags: tuple[str, ...]


SETTINGS = (
    Setting(
        "conv-128-budget",
        "mooncake_conversation",
        ("--block-tokens", "128", "--max-seq-len", "8192", *BUDGET_512),
    ),
    Setting(
        "conv-128-targets",
        "mooncake_conversation",
        ("--block-tokens", "128", "--max-seq-len", "8192", *TARGETS),
    ),
    Setting("conv-64-budget", "mooncake_conversation", ("--block-tokens", "64", *BUDGET_512)),
    Setting("conv-64-targets", "mooncake_conversation", ("--block-tokens", "64", *TARGETS)),
    Setting(
        "syn-64-budget",
        "mooncake_synthetic",
        ("--block-tokens", "64", "--max-seq-len", "8192", *BUDGET_512),
    ),
    Setting(
        "syn-64-targets",
        "mooncake_synthetic",
        ("--block-tokens", "64", "--max-seq-len", "8192", *TARGETS),
    ),
    Setting(
        "syn-128-budget",
        "mooncake_synthetic",
        ("--block-tokens", "128", "--max-seq-len", "8192", *BUDGET_512),
    ),
    Setting(
        "syn-128-targets",
        "mooncake_synthetic",
        ("--block-tokens", "128", "--max-seq-len", "8192", *TARGETS),
    ),
)


@dataclass(frozen=True)
class Figures:
    """What the table and the capacity search read of one run."""

    qps: float
    ttft_p99: float
    tpot_p99: float
    queue_p99: float
    max_share_over_mean: float
    prefix_hit_rate: float
    commit: str = ""
    # Its requests' latencies, sorted (seconds), and its prefill tokens, to pool seeds
    # (empty: a run kept before they were; its cell then takes the seeds' mean p99s).
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    queue: list[float] = field(default_factory=list)
    cached_prefill_tokens: int = 0
    computed_prefill_tokens: int = 0


@dataclass(frozen=True)
class Cell:
    """One cell's figures, as the table shows them: one run's, or pooled over seeds."""

    load: str
    qps: float
    routing: str
    caching: str
    ttft_p99: float
    tpot_p99: float
    queue_p99: float
    max_share: float  # the highest of its runs'
    hit_rate: float
    commit: str = ""  # the service code it ran on
    # Each seed's run, by seed (one seed: the cell is that run).
    runs: dict[int, Figures] = field(default_factory=dict)
    # Whether the p99s are of the seeds' requests pooled (else the mean of their p99s).
    pooled: bool = True


@dataclass(frozen=True)
class Probe:
    """A run as `experiments.find_capacity` reads it."""

    result: Figures


@functools.cache
def _commit() -> str:
    """The last commit that changed service/ (+dirty: with uncommitted changes there),
    read once per process, when its first Runner imports the service's code: the code
    this process runs, whatever is committed later."""
    try:
        out = subprocess.run(
            ["git", "log", "-1", "--format=%h", "--", "service"],
            capture_output=True,
            text=True,
            check=True,
        )
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "service"]).returncode
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip() + ("+dirty" if dirty else "")


class Runner:
    """Runs of one setting in this process (the trace and cost model loaded once), each
    read from the cache when it is there."""

    def __init__(
        self,
        setting: Setting,
        num_requests: int,
        seed: int,
        workers: int,
        cache: Path | None = None,
        cached_only: bool = False,
    ) -> None:
        self.seed = seed
        self._name = f"{setting.name}-n{num_requests}-s{seed}-w{workers}"
        self._cache = cache
        self._cached_only = cached_only
        self._commit = _commit()
        from service.cli.main import main as _  # noqa: F401  (the CLI's imports, once)
        from service.sim import cli

        parser = argparse.ArgumentParser()
        cli.add_parser(parser.add_subparsers(dest="command"))
        self._parser = parser
        self._base = (
            "simulate",
            "--trace",
            setting.trace,
            "--workers",
            str(workers),
            "--num-requests",
            str(num_requests),
            "--seed",
            str(seed),
            "--no-progress",
            *setting.flags,
        )
        self._setups: dict[str, object] = {}

    def _setup_and_config(self, routing: str, caching: str):
        from service import settings
        from service.sim import experiments
        from service.sim.costs import load_cost_source
        from service.sim.simulator import WorkerShape
        from service.sim.workload import load_trace

        args = self._parser.parse_args(
            [*self._base, "--routing", routing, "--prefix-caching", caching]
        )
        config = settings.resolve(args, os.environ).scheduler
        setup = self._setups.get("base")
        if setup is None:
            cost = load_cost_source(
                profile=args.profile, step_table_path=args.step_table, page_size=args.page_size
            )
            trace = load_trace(args.trace, block_tokens=args.block_tokens)
            worker = WorkerShape(
                args.kv_pages or cost.default_kv_pages,
                args.page_size,
                args.gdn_slots or cost.default_gdn_slots,
                cache_block_tokens=trace.block_tokens,
            )
            setup = experiments.Setup(
                trace,
                cost,
                worker,
                args.workers,
                args.num_requests,
                args.arrivals,
                args.seed,
                routing,
                progress=False,
            )
            self._setups["base"] = setup
        return replace(setup, routing=routing), config

    def outcome(self, qps: float, routing: str, caching: str):
        """One run's raw outcome (every request's record), run now, not cached."""
        from service.sim import experiments

        setup, config = self._setup_and_config(routing, caching)
        return experiments.simulate(setup, config, qps).outcome

    def figures(self, qps: float, routing: str, caching: str) -> Figures | None:
        """One run's figures, from the cache or run (None: not cached, cached_only)."""
        path = None
        if self._cache is not None:
            path = self._cache / f"{self._name}-{routing}-{caching}-{qps:.6g}.json"
            if path.exists():
                return Figures(**json.loads(path.read_text()))
        if self._cached_only:
            return None
        from service.sim import experiments
        from service.sim.metrics import latency_samples

        setup, config = self._setup_and_config(routing, caching)
        run = experiments.simulate(setup, config, qps)
        r, samples = run.result, latency_samples(run.outcome)
        figures = Figures(
            qps,
            r.ttft_p99,
            r.tpot_p99,
            r.queue_p99,
            r.max_share_over_mean,
            r.prefix_hit_rate,
            self._commit,
            samples.ttft,
            samples.tpot,
            samples.queue,
            r.cached_prefill_tokens,
            r.computed_prefill_tokens,
        )
        if path is not None:
            path.write_text(json.dumps(asdict(figures)))
        return figures

    def run(self, load: str, qps: float, routing: str, caching: str) -> Cell | None:
        r = self.figures(qps, routing, caching)
        if r is None:
            return None
        return Cell(
            load,
            qps,
            routing,
            caching,
            r.ttft_p99,
            r.tpot_p99,
            r.queue_p99,
            r.max_share_over_mean,
            r.prefix_hit_rate,
            r.commit,
            {self.seed: r},
        )

    def meets_slo(self, caching: str, qps: float) -> bool | None:
        """Whether pull with `caching` meets the SLO at `qps` (one probe; None: not
        cached, cached_only)."""
        r = self.figures(qps, "pull", caching)
        return None if r is None else _slo().met_by(r)

    def capacity(self, caching: str, start_qps: float, tolerance: float, log) -> float | None:
        """Pull's capacity with `caching` (None: a probe not cached, cached_only)."""
        from service.sim import experiments

        slo = _slo()

        class NotCached(Exception):
            pass

        def probe(qps: float) -> Probe:
            r = self.figures(qps, "pull", caching)
            if r is None:
                raise NotCached
            return Probe(r)

        def on_step(n, run, meets):
            r = run.result
            log(
                f"    capacity, caching {caching}, probe {n}: {r.qps:.2f} QPS -> TTFT p99 "
                f"{r.ttft_p99:.3f} s, TPOT p99 {r.tpot_p99 * 1000:.1f} ms"
                f" {'meets' if meets else 'misses'}"
            )

        try:
            found = experiments.find_capacity(
                probe, slo, start_qps=start_qps, on_step=on_step, tolerance=tolerance
            )
        except NotCached:
            return None
        return found.capacity_qps


def pool(cells: list[Cell]) -> Cell:
    """One cell of the same cell's runs at several seeds: its p99s over all their
    requests (the mean of their p99s when a run kept no latencies), its max share the
    highest of theirs, its hit rate over all their prefill tokens."""
    if len(cells) == 1:
        return cells[0]
    runs = {seed: r for c in cells for seed, r in c.runs.items()}
    figures = list(runs.values())
    pooled = all(r.ttft and r.tpot and r.queue for r in figures)
    if pooled:
        ttft_p99, tpot_p99, queue_p99 = (
            percentile(sorted(x for r in figures for x in getattr(r, name)), 99)
            for name in ("ttft", "tpot", "queue")
        )
        prefilled = sum(r.cached_prefill_tokens + r.computed_prefill_tokens for r in figures)
        hit_rate = sum(r.cached_prefill_tokens for r in figures) / prefilled if prefilled else 0.0
    else:
        ttft_p99, tpot_p99, queue_p99, hit_rate = (
            statistics.fmean(getattr(r, name) for r in figures)
            for name in ("ttft_p99", "tpot_p99", "queue_p99", "prefix_hit_rate")
        )
    first = cells[0]
    return Cell(
        first.load,
        first.qps,
        first.routing,
        first.caching,
        ttft_p99,
        tpot_p99,
        queue_p99,
        max(r.max_share_over_mean for r in figures),
        hit_rate,
        ",".join(sorted({r.commit for r in figures})),
        runs,
        pooled,
    )


def measure(
    setting: Setting, args: argparse.Namespace
) -> tuple[list[Cell], dict[str, float | None]]:
    """Every cell of one setting: the light loads' runs, the capacities, then the runs
    at 80% of capacity (with --from-cache, those the cache holds); each cell run at
    every seed and pooled, the capacities at the first seed."""
    started = time.perf_counter()

    def log(text: str) -> None:
        print(f"[{setting.name} {time.perf_counter() - started:5.0f} s] {text}", file=sys.stderr)

    cache = Path(args.cache) if args.cache else None
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
    runners = [
        Runner(setting, args.num_requests, seed, args.workers, cache, args.from_cache)
        for seed in args.seeds
    ]
    runner = runners[0]  # the capacities'
    runs = [("pull", "on"), ("pull", "off")] + [(r, "on") for r in args.routers]
    cells = []

    def run_load(load: str, qps: float) -> None:
        for routing, caching in runs:
            kept = []
            for seed_runner in runners:
                cell = seed_runner.run(load, qps, routing, caching)
                if cell is None:
                    continue
                log(
                    f"{load} ({qps:g}), {routing}, caching {caching}, seed {seed_runner.seed}:"
                    f" TTFT p99 {cell.ttft_p99:.3f} s, TPOT p99 {cell.tpot_p99 * 1000:.1f} ms,"
                    f" max share {cell.max_share:.2f}"
                )
                kept.append(cell)
            if kept:
                cells.append(pool(kept))

    for q in args.qps:
        run_load(f"{q:g} QPS", q)
    if args.light_only:
        return cells, {"off": None, "on": None}
    # The capacity with caching off, searched; with it on, one probe at that rate: if it
    # meets the SLO there, on >= off (to the search's tolerance), else it is searched.
    tolerance = args.capacity_tolerance
    capacity: dict[str, float | None] = {
        "off": runner.capacity("off", args.capacity_start, tolerance, log),
        "on": None,
    }
    if capacity["off"] is None:
        return cells, capacity
    log(f"capacity, caching off: {capacity['off']:.2f} QPS")
    meets = runner.meets_slo("on", capacity["off"]) if capacity["off"] else False
    if meets:
        capacity["on"] = capacity["off"]
        log(f"caching on meets the SLO at {capacity['off']:.2f} QPS too")
    elif meets is not None:
        capacity["on"] = runner.capacity("on", args.capacity_start, tolerance, log)
        if capacity["on"] is not None:
            log(f"capacity, caching on: {capacity['on']:.2f} QPS")
    if capacity["off"]:
        run_load("80% of capacity", round(0.8 * capacity["off"], 2))
    return cells, capacity


def table(results: list[tuple[Setting, list[Cell], dict[str, float]]]) -> str:
    rows = []
    for setting, cells, capacity in results:
        off = {c.load: c for c in cells if c.routing == "pull" and c.caching == "off"}
        for c in cells:
            base = off.get(c.load)
            ratio = (
                f"{c.ttft_p99 / base.ttft_p99:.2f} / {c.tpot_p99 / base.tpot_p99:.2f}"
                if _comparable(c, base)
                else ""
            )
            mean = "" if c.pooled else " *"
            rows.append(
                [
                    setting.name,
                    f"{c.load} ({c.qps:g})" if c.load.startswith("80") else c.load,
                    c.routing,
                    c.caching,
                    _seeds(c),
                    f"{c.ttft_p99:.3f}{mean}",
                    f"{c.tpot_p99 * 1000:.1f}{mean}",
                    ratio,
                    f"{c.queue_p99:.3f}{mean}",
                    f"{c.max_share:.2f}",
                    f"{c.hit_rate:.3f}",
                ]
            )
        if capacity["off"] is None:
            continue
        if capacity["on"] is None:
            on, ratio = "not run", ""
        elif capacity["on"] == capacity["off"]:
            on, ratio = f">= {capacity['off']:.2f}", ">= 1.00"
        else:
            on = f"{capacity['on']:.2f}"
            ratio = f"{capacity['on'] / capacity['off']:.2f}" if capacity["off"] else ""
        rows.append(
            [
                setting.name,
                "capacity QPS",
                "pull",
                "on / off",
                "",
                f"{on} / {capacity['off']:.2f}",
                "",
                ratio,
                "",
                "",
                "",
            ]
        )
    header = [
        "setting",
        "load",
        "routing",
        "caching",
        "seeds",
        "TTFT p99 s",
        "TPOT p99 ms",
        "vs pull off (TTFT / TPOT)",
        "queue p99 s",
        "max share / mean",
        "hit rate",
    ]
    return markdown_table(header, rows)


def _comparable(cell: Cell, base: Cell | None) -> bool:
    """Whether `cell` is read against `base`: another cell, of the same seeds."""
    return base is not None and cell is not base and cell.runs.keys() == base.runs.keys()


def _seeds(cell: Cell) -> str:
    """The seeds of a cell's runs: "0-2", or "0, 2" when not consecutive."""
    seeds = sorted(cell.runs)
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}-{seeds[-1]}"
    return ", ".join(map(str, seeds))


def seed_ratios(
    results: list[tuple[Setting, list[Cell], dict[str, float | None]]], near: float = 1.0
) -> list[str]:
    """Pull with caching on against off, seed by seed, for the cells near the target:
    pooled at `near` or above, or a seed above 1.05x (TTFT or TPOT p99)."""
    found = []
    for setting, cells, _ in results:
        off = {c.load: c for c in cells if c.routing == "pull" and c.caching == "off"}
        for c in cells:
            base = off.get(c.load)
            if c.routing != "pull" or c.caching != "on" or not _comparable(c, base):
                continue
            seeds = sorted(c.runs)
            if len(seeds) < 2:
                continue
            parts, shown = [], False
            for name, pooled, attr in (
                ("TTFT", c.ttft_p99 / base.ttft_p99, "ttft_p99"),
                ("TPOT", c.tpot_p99 / base.tpot_p99, "tpot_p99"),
            ):
                each = [getattr(c.runs[s], attr) / getattr(base.runs[s], attr) for s in seeds]
                shown |= pooled >= near or max(each) > 1.05
                per_seed = ", ".join(f"s{s} {r:.3f}" for s, r in zip(seeds, each, strict=True))
                parts.append(f"{name} {pooled:.3f} ({per_seed})")
            if shown:
                found.append(f"{setting.name}, {c.load}: " + "; ".join(parts))
    return found


def misses(results: list[tuple[Setting, list[Cell], dict[str, float | None]]]) -> list[str]:
    """The cells off the issue's targets: pull with caching on against off above 1.05x
    (TTFT or TPOT p99, unrounded), pull's max share / mean above 1.2, capacity on < off."""
    found = []
    for setting, cells, capacity in results:
        off = {c.load: c for c in cells if c.routing == "pull" and c.caching == "off"}
        for c in cells:
            if c.routing != "pull":
                continue
            where = f"{setting.name}, {c.load}, caching {c.caching}"
            if c.max_share > 1.2:
                found.append(f"{where}: max share / mean {c.max_share:.2f}")
            base = off.get(c.load)
            if c.caching == "on" and _comparable(c, base):
                for name, on, of in (
                    ("TTFT", c.ttft_p99, base.ttft_p99),
                    ("TPOT", c.tpot_p99, base.tpot_p99),
                ):
                    if on > 1.05 * of:
                        found.append(f"{where}: {name} p99 {on / of:.3f}x off's")
        if capacity["on"] is not None and capacity["off"] and capacity["on"] < capacity["off"]:
            found.append(f"{setting.name}: capacity on {capacity['on'] / capacity['off']:.2f}x")
    return found


def main() -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.placement_regression", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--settings",
        default=",".join(s.name for s in SETTINGS),
        help="comma-separated, of: " + ", ".join(s.name for s in SETTINGS),
    )
    p.add_argument("--num-requests", type=int, default=200, help="per run (default %(default)s)")
    p.add_argument("--qps", default="1,2", help="the light loads (default %(default)s)")
    p.add_argument(
        "--routers",
        default="prefix-load",
        help="the peers' routers run beside pull, caching on (default: llm-d's, the best of "
        "them in docs/simulation.md's tables)",
    )
    p.add_argument("--workers", type=int, default=4)
    p.add_argument(
        "--seeds",
        default="0",
        help="comma-separated: each cell run at each, its figures pooled; the capacities "
        "at the first (default %(default)s)",
    )
    p.add_argument("--capacity-start", type=float, default=4.0)
    p.add_argument("--capacity-tolerance", type=float, default=0.1)
    p.add_argument("--jobs", type=int, default=1, help="settings run at once (processes)")
    p.add_argument(
        "--light-only",
        action="store_true",
        help="the light loads' cells only, no capacity (a first pass over many settings)",
    )
    p.add_argument("--cache", help="a folder that keeps each run's figures (resumable)")
    p.add_argument(
        "--from-cache",
        action="store_true",
        help="run nothing: the table of what --cache holds",
    )
    args = p.parse_args()
    args.qps = [float(q) for q in args.qps.split(",") if q]
    args.routers = [r for r in args.routers.split(",") if r]
    args.seeds = [int(x) for x in args.seeds.split(",") if x]
    if args.from_cache and not args.cache:
        p.error("--from-cache needs --cache")
    by_name = {s.name: s for s in SETTINGS}
    settings = [by_name[name] for name in args.settings.split(",") if name]
    started = time.perf_counter()
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            measured = list(pool.map(measure, settings, [args] * len(settings)))
    else:
        measured = []
        for setting in settings:
            measured.append(measure(setting, args))
            # Each setting's rows as it ends, so that a run cut short keeps them.
            print(table([(setting, *measured[-1])]), file=sys.stderr)
    results = [(s, cells, cap) for s, (cells, cap) in zip(settings, measured, strict=True)]
    print(table(results))
    print("\nOff target:" if misses(results) else "\nEvery cell on target.")
    for line in misses(results):
        print(f"- {line}")
    near = seed_ratios(results)
    if near:
        print("\nPull, caching on vs off, per seed (the cells near the target):")
        for line in near:
            print(f"- {line}")
    if any(not c.pooled for _, cells, _ in results for c in cells):
        print("\n* the mean of the seeds' p99s (runs kept without their latencies)")
    commits = Counter(c.commit for _, cells, _ in results for c in cells)
    print("\nService code of the cells: " + ", ".join(f"{k} ({n})" for k, n in commits.items()))
    print(
        f"\n{args.num_requests} requests a run, {args.workers} workers, seeds "
        f"{','.join(map(str, args.seeds))} (capacities: seed {args.seeds[0]}); "
        f"{time.perf_counter() - started:.0f} s wall; load average "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
