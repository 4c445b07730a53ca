#!/usr/bin/env python3
"""How well the scheduler learns each worker's step time: the simulator, a TPOT target,
and the relative error |predicted - measured| / measured of every step time the
scheduler learned from (predicted before the step was learned), per worker, over steps
1-200 and after step 200.

The simulator's workers report their steps' cost-model times through the worker loop's
`last_step_us`, as real workers report their measured ones: the scheduler is not told the
cost model, and starts from the cautious default.

    .venv/bin/python -m bench.learning                       # A30 profile, code trace
    .venv/bin/python -m bench.learning --step-table FILE     # a `lattice-worker profile`
    .venv/bin/python -m bench.learning --workers 4 --worker-speeds 1,1,0.5,0.5 --qps 8
"""

from __future__ import annotations

import argparse
import statistics

from common.loadgen import percentile
from service.core import SchedulerConfig
from service.sim import experiments
from service.sim.costs import load_cost_source
from service.sim.simulator import WorkerShape
from service.sim.workload import load_trace


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.learning", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--profile", default=None)
    parser.add_argument("--step-table", default=None)
    parser.add_argument("--trace", default="splitwise_code")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--qps", type=float, default=2.0)
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--tpot-target-ms", type=float, default=100.0)
    parser.add_argument("--kv-pages", type=int, default=None)
    parser.add_argument(
        "--worker-speeds", default="", help="one speed per worker, e.g. 1,1,0.5,0.5 (a mixed fleet)"
    )
    args = parser.parse_args()

    cost = load_cost_source(profile=args.profile, step_table_path=args.step_table, page_size=16)
    kv_pages = args.kv_pages or cost.default_kv_pages or 4096
    setup = experiments.Setup(
        load_trace(args.trace),
        cost,
        WorkerShape(kv_pages, 16, cost.default_gdn_slots),
        args.workers,
        args.num_requests,
        "poisson",
        0,
        "pull",
        progress=False,
        worker_speeds=tuple(float(v) for v in args.worker_speeds.split(",") if v),
    )
    config = SchedulerConfig(policy="budget", tpot_target_ms=args.tpot_target_ms)
    run = experiments.simulate(setup, config, args.qps)
    print(
        f"cost model {cost.name}, trace {args.trace}, {args.workers} worker(s), "
        f"{args.num_requests} requests at {args.qps:g} QPS, --tpot-target-ms "
        f"{args.tpot_target_ms:g}: TPOT p99 {run.result.tpot_p99 * 1000:.1f} ms"
    )
    print(
        f"{'worker':<8}{'speed':>6}{'steps':>7}{'median err 1-200':>18}"
        f"{'median err >200':>17}{'p90 err >200':>14}{'TPOT p99 ms':>13}"
    )
    for index, (worker_id, errors) in enumerate(sorted(run.outcome.step_time_errors.items())):
        first, later = errors[:200], errors[200:]
        speed = setup.worker_speeds[index] if setup.worker_speeds else 1.0
        print(
            f"{worker_id:<8}{speed:>6g}{len(errors):>7}{_pct(statistics.median, first):>18}"
            f"{_pct(statistics.median, later):>17}"
            f"{_pct(lambda e: sorted(e)[int(len(e) * 0.9)], later):>14}"
            f"{_tpot_p99(run.outcome.records, worker_id) * 1000:>13.1f}"
        )
    return 0


def _tpot_p99(records, worker_id: str) -> float:
    """TPOT p99 of the requests whose latest admission was to `worker_id`."""
    tpot = sorted(
        (r.last_token_at - r.first_token_at) / (r.num_tokens - 1)
        for r in records
        if r.worker_id == worker_id and r.num_tokens > 1
    )
    return percentile(tpot, 99) if tpot else 0.0


def _pct(stat, values: list[float]) -> str:
    return f"{stat(values) * 100:.1f}%" if values else "-"


if __name__ == "__main__":
    raise SystemExit(main())
