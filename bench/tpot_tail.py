"""Who sets a cell's TPOT p99 (docs/policies.md, "Placement: the regression table"): the
worst-TPOT requests of one bench.placement_regression setting at one rate, caching on
and off (pull routing, 1,000 requests, seed 0), each with its output length, its
worker, its prompt, how many other requests that worker held while it decoded, and the
prompts whose prefill ran on that worker while it decoded (their steps carried that
prefill beside its decodes): each one's length, when it was admitted against the
request's own admission (+: after it), and every worker's load (requests held) at that
moment, that worker's first.

    .venv/bin/python -m bench.tpot_tail conv-128-budget 1
"""

from __future__ import annotations

import argparse

from bench.placement_regression import SETTINGS, Runner
from common.loadgen import percentile


def tpot(r) -> float:
    return (r.last_token_at - r.first_token_at) / (r.num_tokens - 1)


def held_at(records, worker_id: str, at: float) -> int:
    """Requests `worker_id` held at `at`: admitted by then, not yet finished."""
    return sum(
        1
        for o in records
        if o.worker_id == worker_id
        and o.admitted_at is not None
        and o.admitted_at <= at
        and (o.finished_at is None or o.finished_at > at)
    )


def describe(r, records, worker_ids) -> str:
    mine = [o for o in records if o is not r and o.worker_id == r.worker_id and o.admitted_at]
    # Held beside it: decoding or prefilling at its decode window's midpoint.
    mid = (r.first_token_at + r.last_token_at) / 2
    beside = held_at(mine, r.worker_id, mid)
    # Prefills that ran while it decoded: admitted before its last token, first token after
    # its first.
    prefills = [
        o
        for o in mine
        if o.admitted_at < r.last_token_at
        and (o.first_token_at is None or o.first_token_at > r.first_token_at)
    ]
    parts = []
    for o in sorted(prefills, key=lambda o: o.admitted_at):
        loads = [held_at(records, w, o.admitted_at) for w in worker_ids if w != r.worker_id]
        own = held_at(records, r.worker_id, o.admitted_at)
        parts.append(
            f"{o.request.prompt_len}p at {o.admitted_at - r.admitted_at:+.2f}s "
            f"(loads {own} | {' '.join(map(str, loads))})"
        )
    return (
        f"  TPOT {tpot(r) * 1000:5.1f} ms, {r.num_tokens:4d} out, prompt "
        f"{r.request.prompt_len:5d}, {r.worker_id}, {beside} beside; prefills: "
        + ("; ".join(parts) or "none")
    )


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.tpot_tail", description=__doc__)
    p.add_argument("setting", choices=[s.name for s in SETTINGS])
    p.add_argument("qps", type=float)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--worst", type=int, default=12)
    p.add_argument("--caching", default="on,off", help="which runs (default %(default)s)")
    args = p.parse_args()
    runner = Runner({s.name: s for s in SETTINGS}[args.setting], args.num_requests, 0, 4)
    for caching in args.caching.split(","):
        records = runner.outcome(args.qps, "pull", caching).records
        worker_ids = sorted({r.worker_id for r in records if r.worker_id})
        served = [r for r in records if r.first_token_at is not None and r.num_tokens > 1]
        served.sort(key=tpot, reverse=True)
        p99 = percentile(sorted(map(tpot, served)), 99)
        print(f"caching {caching}: TPOT p99 {p99 * 1000:.1f} ms; the worst {args.worst}:")
        for r in served[: args.worst]:
            print(describe(r, records, worker_ids), flush=True)


if __name__ == "__main__":
    main()
