#!/usr/bin/env python3
"""The capacity table of docs/simulation.md: the highest QPS that meets each SLO, per shipped
trace, worker count, policy (with its settings) and routing.

Each cell is `lattice-scheduler simulate --find-capacity` for two SLOs (TTFT p99 <= 2 s and
TPOT p99 <= 100 ms; TTFT p99 <= 5 s and TPOT p99 <= 200 ms), sharing the runs both
searches make. Prints a markdown table as cells finish, and writes every run to --json.

    python -m bench.sim_results                       # everything (an hour or more)
    python -m bench.sim_results --traces sharegpt --workers 1 \\
        --variants fifo budget:max_num_batched_tokens=512 fifo@round-robin
A variant is POLICY[:SETTING=VALUE,...][@ROUTING].
"""

from __future__ import annotations

import argparse
import json
import time

from service.core import SchedulerConfig
from service.sim import experiments
from service.sim.costs import load_cost_source
from service.sim.simulator import WorkerShape
from service.sim.workload import load_trace

SLOS = (experiments.Slo(2.0, 0.100), experiments.Slo(5.0, 0.200))


def parse_variant(text: str) -> tuple[SchedulerConfig, str, str]:
    """(config, routing, label) of POLICY[:SETTING=VALUE,...][@ROUTING]."""
    text, _, routing = text.partition("@")
    policy, _, settings = text.partition(":")
    values = {}
    for item in filter(None, settings.split(",")):
        name, _, value = item.partition("=")
        values[name] = _number(value)
    config = SchedulerConfig(policy=policy, **values).validate()
    label = policy + (f" ({', '.join(f'{k}={v}' for k, v in values.items())})" if values else "")
    return config, routing or "pull", label


def _number(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.sim_results",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--traces", default="sharegpt,splitwise_conv,splitwise_code")
    parser.add_argument("--workers", default="1,4")
    parser.add_argument(
        "--variants", nargs="+", default=["fifo", "fifo@round-robin", "fifo@least-loaded"]
    )
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.1,
        help="stop bisecting when passing and failing QPS are this close",
    )
    parser.add_argument("--json", default="sim_results.json")
    args = parser.parse_args()

    cost = load_cost_source(profile="a30-qwen2-7b", step_table_path=None, page_size=16)
    worker = WorkerShape(cost.default_kv_pages, 16, cost.default_gdn_slots)
    variants = [parse_variant(v) for v in args.variants]
    out = []
    print(
        f"A30 Qwen2-7B profile, {worker.total_kv_pages} KV pages of 16 tokens per worker, "
        f"{args.num_requests} requests per run, Poisson arrivals, seed 0, bisection to "
        f"{args.tolerance:.0%}"
    )
    print(
        "| trace | workers | policy | routing | QPS at 2 s / 100 ms | QPS at 5 s / 200 ms "
        "| runs | wall s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    for trace_name in args.traces.split(","):
        trace = load_trace(trace_name)
        for num_workers in (int(w) for w in args.workers.split(",")):
            for config, routing, label in variants:
                setup = experiments.Setup(
                    trace,
                    cost,
                    worker,
                    num_workers,
                    args.num_requests,
                    "poisson",
                    0,
                    routing,
                    progress=False,
                )
                runs: dict[float, experiments.Run] = {}

                def run_at(qps: float, runs=runs, setup=setup, config=config) -> experiments.Run:
                    key = round(qps, 6)
                    if key not in runs:
                        runs[key] = experiments.simulate(setup, config, qps)
                    return runs[key]

                started = time.perf_counter()
                capacities = []
                start = 0.5 * num_workers
                for slo in SLOS:
                    capacity = experiments.find_capacity(
                        run_at, slo, start_qps=start, tolerance=args.tolerance
                    )
                    capacities.append(capacity.capacity_qps)
                    start = max(capacity.capacity_qps, start)
                wall = time.perf_counter() - started
                print(
                    f"| {trace_name} | {num_workers} | {label} | {routing} | "
                    f"{capacities[0]:.2f} | {capacities[1]:.2f} | {len(runs)} | {wall:.0f} |",
                    flush=True,
                )
                out.append(
                    {
                        "trace": trace_name,
                        "workers": num_workers,
                        "policy": label,
                        "routing": routing,
                        "capacity_qps": capacities,
                        "runs": [r.result.to_json() for r in runs.values()],
                    }
                )
                with open(args.json, "w") as f:
                    json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
