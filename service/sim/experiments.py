"""Runs, capacity searches and policy comparisons built from single simulations."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from service.core import FinishReason, SchedulerConfig
from service.sim.costs import CostSource
from service.sim.metrics import RunResult, summarize
from service.sim.simulator import RunOutcome, RunSpec, Simulation, WorkerShape
from service.sim.transfer import Roles, TransferModel
from service.sim.workload import Trace, make_requests

# A capacity search stops when the highest passing and lowest failing QPS are this close.
CAPACITY_TOLERANCE = 0.05
MAX_DOUBLINGS = 12
# The arrival rate of a saturation run: far above what any simulated fleet completes, so
# that the queue never runs dry before the last arrival.
SATURATION_QPS = 1000.0


@dataclass(frozen=True)
class Setup:
    """What every run of one command shares."""

    trace: Trace
    cost: CostSource
    worker: WorkerShape
    num_workers: int
    num_requests: int
    arrivals: str
    seed: int
    routing: str
    progress: bool = True
    worker_speeds: tuple[float, ...] = ()
    roles: Roles | None = None  # a prefill/decode split; None: every worker runs both
    transfer: TransferModel = field(default_factory=TransferModel)


@dataclass(frozen=True)
class Run:
    """One simulation's figures, its raw outcome and what it cost to compute."""

    result: RunResult
    outcome: RunOutcome
    wall_seconds: float

    @property
    def num_failed(self) -> int:
        return sum(r.finish_reason is FinishReason.FAILED for r in self.outcome.records)


def simulate(setup: Setup, config: SchedulerConfig, qps: float) -> Run:
    """Simulate setup.num_requests requests at `qps` under `config`."""
    requests = make_requests(
        setup.trace,
        num_requests=setup.num_requests,
        qps=qps,
        arrivals=setup.arrivals,
        seed=setup.seed,
        max_seq_len=config.max_seq_len,
    )
    spec = RunSpec(
        config,
        setup.worker,
        setup.num_workers,
        setup.routing,
        setup.worker_speeds,
        setup.seed,
        setup.roles,
        setup.transfer,
    )
    split = f" {setup.roles.name}" if setup.roles else ""
    bar = _progress_bar(setup, f"{config.policy} {setup.routing}{split} {qps:g} QPS")
    started = time.perf_counter()
    try:
        outcome = Simulation(
            spec, setup.cost.model, requests, on_finish=bar.update if bar else None
        ).run()
    finally:
        if bar is not None:
            bar.close()
    wall = time.perf_counter() - started
    result = summarize(
        outcome, policy=config.policy, qps=qps, workers=setup.num_workers, routing=setup.routing
    )
    return Run(result, outcome, wall)


@dataclass(frozen=True)
class Slo:
    """Service-level objectives on the 99th percentiles, in seconds."""

    ttft_p99: float
    tpot_p99: float

    def met_by(self, result: RunResult) -> bool:
        return result.ttft_p99 <= self.ttft_p99 and result.tpot_p99 <= self.tpot_p99


@dataclass(frozen=True)
class Capacity:
    """The highest QPS found to meet the SLO, and every run the search made, in order."""

    capacity_qps: float
    runs: tuple[Run, ...] = field(default=())


def find_capacity(
    run_at: Callable[[float], Run],
    slo: Slo,
    *,
    start_qps: float,
    on_step: Callable[[int, Run, bool], None] | None = None,
    tolerance: float = CAPACITY_TOLERANCE,
) -> Capacity:
    """Double (or halve) the QPS from start_qps until the SLO flips, then bisect until the
    passing and failing rates are within `tolerance` of each other.

    Capacity 0 when even start_qps / 2**MAX_DOUBLINGS misses the SLO; the search stops at
    start_qps * 2**MAX_DOUBLINGS if nothing misses it.
    """
    runs: list[Run] = []

    def probe(qps: float) -> bool:
        run = run_at(qps)
        runs.append(run)
        meets = slo.met_by(run.result)
        if on_step:
            on_step(len(runs), run, meets)
        return meets

    passing, failing = None, None
    qps = start_qps
    for _ in range(MAX_DOUBLINGS + 1):
        if probe(qps):
            passing = qps
            if failing is not None:
                break
            qps *= 2
        else:
            failing = qps
            if passing is not None:
                break
            qps /= 2
    if passing is None:
        return Capacity(0.0, tuple(runs))
    if failing is None:
        return Capacity(passing, tuple(runs))
    while failing / passing > 1 + tolerance:
        middle = (passing * failing) ** 0.5
        if probe(middle):
            passing = middle
        else:
            failing = middle
    return Capacity(passing, tuple(runs))


def find_capacity_shown(
    title: str,
    run_at: Callable[[float], Run],
    slo: Slo,
    *,
    start_qps: float,
    tolerance: float = CAPACITY_TOLERANCE,
    detail: Callable[[Run], str] | None = None,
) -> Capacity:
    """find_capacity with its progress printed: a heading naming `title` and the SLO, then
    one line per probe (what `detail` says of the run added in its parentheses), and a
    warning for a probe whose requests finished FAILED."""
    print(
        f"\nfind capacity: {title}, SLO TTFT p99 <= {slo.ttft_p99:g} s and TPOT p99 <= "
        f"{slo.tpot_p99 * 1000:g} ms",
        flush=True,
    )

    def on_step(n: int, run: Run, meets: bool) -> None:
        r = run.result
        warn_failed(run)
        extra = f"{detail(run)}; " if detail else ""
        print(
            f"  step {n}: {r.qps:.3f} QPS -> TTFT p99 {r.ttft_p99:.3f} s, TPOT p99 "
            f"{r.tpot_p99 * 1000:.1f} ms: {'meets' if meets else 'misses'} the SLO "
            f"({extra}{run.wall_seconds:.1f} s wall)",
            flush=True,
        )

    return find_capacity(run_at, slo, start_qps=start_qps, on_step=on_step, tolerance=tolerance)


def warn_failed(run: Run) -> None:
    """On stderr: the requests of `run` that finished FAILED, left out of its figures."""
    if run.num_failed:
        print(
            f"warning: {run.num_failed} request(s) at {run.result.qps:g} QPS finished "
            f"FAILED (longer than a worker's whole KV pool); the figures leave them out",
            file=sys.stderr,
        )


@dataclass(frozen=True)
class Saturation:
    """The steady-state completion rate of an overloaded fleet: N requests over the
    difference of the makespans of runs of N and 2N requests at SATURATION_QPS (the
    start-up and drain, alike in both, cancel out)."""

    requests_per_second: float
    runs: tuple[Run, Run]


def saturation(setup: Setup, config: SchedulerConfig, qps: float = SATURATION_QPS) -> Saturation:
    """Measure `config`'s saturation rate with setup.num_requests (N) and 2N requests."""
    small = simulate(setup, config, qps)
    large = simulate(replace(setup, num_requests=2 * setup.num_requests), config, qps)
    extra = large.outcome.end_seconds - small.outcome.end_seconds
    rate = setup.num_requests / extra if extra > 0 else float("inf")
    return Saturation(rate, (small, large))


def with_policy(config: SchedulerConfig, policy: str) -> SchedulerConfig:
    return replace(config, policy=policy).validate()


def _progress_bar(setup: Setup, description: str):
    """A tqdm bar over finished requests, shown once a run takes over a second on a TTY."""
    if not setup.progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # the sim extra is not installed: run without a bar
        return None
    return tqdm(
        total=setup.num_requests,
        desc=description,
        unit="req",
        leave=False,
        delay=1.0,
        file=sys.stderr,
        disable=None,
    )
