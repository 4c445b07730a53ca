#!/usr/bin/env python3
"""How fast `lattice-scheduler simulate` runs, and what the wire mapping costs in it.

The target: 2,000 requests on 4 workers with the A30 profile in <= 60 s. For each
QPS this prints the wall time of one simulation (the `simulate` path: Scheduler, WorkerLoop,
convert.py both ways, SimEngine, cost model), the worker iterations it made, the time per
iteration, and the share spent in service/server/convert.py's mapping (worker_report and
decision, timed around each call).

    python -m bench.sim                          # sharegpt, 2000 requests, 4 workers
    python -m bench.sim --qps 2,8,32 --trace splitwise_conv
"""

from __future__ import annotations

import argparse
import time

from service.core import SchedulerConfig
from service.server import convert
from service.sim import experiments
from service.sim.costs import load_cost_source
from service.sim.simulator import WorkerShape
from service.sim.workload import load_trace


class _Timed:
    """Wraps a function of service.server.convert and adds up the seconds spent in it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.original = getattr(convert, name)
        self.seconds = 0.0

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return self.original(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.sim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--trace", default="sharegpt")
    parser.add_argument("--qps", default="2,8,16")
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--policy", default="fifo")
    args = parser.parse_args()

    cost = load_cost_source(profile="a30-qwen2-7b", step_table_path=None, page_size=16)
    setup = experiments.Setup(
        load_trace(args.trace),
        cost,
        WorkerShape(cost.default_kv_pages, 16, cost.default_gdn_slots),
        args.workers,
        args.num_requests,
        "poisson",
        0,
        "pull",
        progress=False,
    )
    config = SchedulerConfig(policy=args.policy)
    print(
        f"{args.num_requests} requests of {args.trace}, {args.workers} workers, "
        f"{args.policy}, A30 Qwen2-7B profile"
    )
    print(
        f"{'QPS':>6}  {'wall s':>7}  {'iterations':>10}  {'us/iteration':>12}  "
        f"{'convert.py share':>16}  {'makespan s':>10}"
    )
    for qps in (float(q) for q in args.qps.split(",")):
        timers = [_Timed("worker_report"), _Timed("decision")]
        for timer in timers:
            setattr(convert, timer.name, timer)
        try:
            run = experiments.simulate(setup, config, qps)
        finally:
            for timer in timers:
                setattr(convert, timer.name, timer.original)
        iterations = run.outcome.num_iterations
        share = sum(t.seconds for t in timers) / run.wall_seconds
        print(
            f"{qps:>6g}  {run.wall_seconds:>7.1f}  {iterations:>10}  "
            f"{run.wall_seconds / iterations * 1e6:>12.0f}  {share:>15.0%}  "
            f"{run.result.makespan:>10.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
