"""Who sets a cell's TPOT p99 (docs/policies.md, "Placement: the regression table"): the
worst-TPOT requests of one bench.placement_regression setting at one rate, caching on
and off (pull routing, 1,000 requests, seed 0), each with its output length, its
worker, and the other requests that worker admitted while it decoded (their prompts
are the prefill its steps carried).

    .venv/bin/python -m bench.tpot_tail conv-128-budget 1
"""

from __future__ import annotations

import argparse

from bench.placement_regression import SETTINGS, Runner
from common.loadgen import percentile


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.tpot_tail", description=__doc__)
    p.add_argument("setting", choices=[s.name for s in SETTINGS])
    p.add_argument("qps", type=float)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--worst", type=int, default=12)
    args = p.parse_args()
    runner = Runner({s.name: s for s in SETTINGS}[args.setting], args.num_requests, 0, 4)
    for caching in ("on", "off"):
        records = runner.outcome(args.qps, "pull", caching).records
        served = [r for r in records if r.first_token_at is not None and r.num_tokens > 1]

        def tpot(r) -> float:
            return (r.last_token_at - r.first_token_at) / (r.num_tokens - 1)

        served.sort(key=tpot, reverse=True)
        p99 = percentile(sorted(map(tpot, served)), 99)
        print(f"caching {caching}: TPOT p99 {p99 * 1000:.1f} ms; the worst {args.worst}:")
        for r in served[: args.worst]:
            beside = [
                o
                for o in records
                if o is not r
                and o.worker_id == r.worker_id
                and o.admitted_at is not None
                and r.first_token_at <= o.admitted_at <= r.last_token_at
            ]
            print(
                f"  TPOT {tpot(r) * 1000:5.1f} ms, {r.num_tokens:4d} tokens out, on "
                f"{r.worker_id}; admitted beside it: {len(beside)}, prompts "
                f"{sum(o.request.prompt_len for o in beside)} tokens"
            )


if __name__ == "__main__":
    main()
