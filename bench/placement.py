#!/usr/bin/env python3
"""The CPU cost of cache-aware placement per decision (docs/policies.md, "Placement").

The core in process: W workers with prefix caches (64-token blocks), each reporting the
resume points of its own conversation families (a 1,024-token shared prefix each); Q
sequences queued, each a family's prefix plus a 64-token tail of its own, in random
family order. Every decision is one worker's call with room for A admissions (the
admitted ones are finished at its next call and replaced in the queue, so the queue
stays at Q). Prints the thread CPU time per decision, median and p99, on the same
calls: --prefix-caching off (the queue order, no lookups); on without placement (the
queue order with each admission's own-cache lookup, as before placement existed: the placement
rule switched off in process); on (placement). Beside each, the admissions per decision
and the CPU time per admission: placement admits W's hits (64 tokens to compute), the
queue order mostly other families' prompts (1,088), so under a token budget placement
admits more per decision and its decisions cost more for that alone;
`--max-num-batched-tokens 100000` lets every setting admit --admit a decision.

The placement row also says how much of its time went to the peers' prompt backlogs
(`FleetView.backlog_tokens`: a sum over a peer's assigned sequences, once per peer and
decision that prices a deferral), timed around every call (memoized ones included: an
upper bound). A worker holds at most --admit sequences here (each finished at its next
call), so --admit sets the length of those sums.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import replace

from common.block_hash import block_hashes
from service.core import FinishReason, Scheduler
from service.core.config import SchedulerConfig
from service.core.decide import fleet
from service.core.decide.policies import placement
from service.core.types import (
    CacheReport,
    FinishedSequence,
    SubmitParams,
    WorkerRegistration,
    WorkerReport,
)

BLOCK = 64
PREFIX_TOKENS = 1024


def run(prefix_caching: str, args) -> tuple[list[float], int]:
    """Thread CPU seconds of each decision after the first round, and the admissions
    those decisions made."""
    rng = random.Random(args.seed)
    sched = Scheduler(
        SchedulerConfig(
            policy=args.policy,
            max_batch_size=args.admit,
            prefix_caching=prefix_caching,
            max_queue=10**6,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    )
    workers = [f"w{i}" for i in range(args.workers)]
    families = [
        [rng.randrange(1, 30000) for _ in range(PREFIX_TOKENS)] for _ in range(args.families)
    ]
    owned = {w: [] for w in workers}
    for f, tokens in enumerate(families):
        owned[workers[f % len(workers)]] += block_hashes(tokens, "", BLOCK)
    for w in workers:
        sched.register_worker(
            WorkerRegistration(
                worker_id=w,
                total_kv_pages=100_000,
                page_size=16,
                total_gdn_slots=1024,
                cache_block_tokens=BLOCK,
                total_snapshot_slots=1024,
            )
        )

    def submit() -> None:
        tokens = families[rng.randrange(len(families))] + [
            rng.randrange(30000, 40000) for _ in range(64)
        ]
        sched.submit(SubmitParams(prompt_token_ids=tuple(tokens), max_new_tokens=4))

    for _ in range(args.queued):
        submit()
    held = {w: [] for w in workers}
    seconds = []
    num_admitted = 0
    for call in range(args.decisions):
        w = workers[call % len(workers)]
        report = WorkerReport(
            worker_id=w,
            waiting=(),
            running=(),
            kv_free_pages=100_000,
            gdn_free_slots=1024,
            finished=tuple(FinishedSequence(s, FinishReason.EOS, 0) for s in held[w]),
        )
        if call < len(workers):
            report = replace(report, cache=CacheReport(tuple(owned[w]), (), True))
        for _ in held[w]:
            submit()
        started = time.thread_time()
        decision = sched.select_batch(report)
        seconds.append(time.thread_time() - started)
        held[w] = [c.seq_id for c in decision.prefill]
        if call >= len(workers):
            num_admitted += len(decision.prefill)
    return seconds[len(workers) :], num_admitted


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.placement", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--families", type=int, default=32)
    parser.add_argument("--queued", type=int, default=2000)
    parser.add_argument("--admit", type=int, default=8, help="admissions per decision (its batch)")
    parser.add_argument("--decisions", type=int, default=2000)
    parser.add_argument("--policy", default="budget", choices=("fifo", "budget", "fair"))
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=0,
        help="the token budget of a decision (default 0: the policy's)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(
        f"{args.workers} workers, {args.families} families of {PREFIX_TOKENS} tokens, "
        f"{args.queued} queued, up to {args.admit} admissions a decision, "
        f"{args.decisions} decisions, policy {args.policy}, max_num_batched_tokens "
        f"{args.max_num_batched_tokens}"
    )
    start = placement.PlacementRule.start
    backlog_tokens = fleet.FleetView.backlog_tokens
    in_backlog = [0.0, 0]  # thread CPU seconds, calls

    def timed_backlog_tokens(self, worker_id: str) -> int:
        started = time.thread_time()
        try:
            return backlog_tokens(self, worker_id)
        finally:
            in_backlog[0] += time.thread_time() - started
            in_backlog[1] += 1

    for label, setting, rule in (
        ("off", "off", start),
        ("on, without placement", "on", lambda self, view: None),
        ("on, with placement", "on", start),
    ):
        placement.PlacementRule.start = rule
        fleet.FleetView.backlog_tokens = timed_backlog_tokens
        in_backlog[:] = [0.0, 0]
        try:
            seconds, num_admitted = run(setting, args)
        finally:
            fleet.FleetView.backlog_tokens = backlog_tokens
        us = sorted(s * 1e6 for s in seconds)
        print(
            f"--prefix-caching {label}: median {statistics.median(us):.0f} us, "
            f"p99 {us[int(len(us) * 0.99)]:.0f} us per decision (thread CPU time); "
            f"{num_admitted / len(us):.2f} admissions a decision, "
            f"{sum(us) / max(1, num_admitted):.0f} us per admission"
        )
        calls = args.decisions  # the backlog timer ran in every decision, the first ones too
        if in_backlog[1]:
            print(
                f"    of which peers' backlogs: {in_backlog[0] * 1e6 / calls:.1f} us per "
                f"decision, {in_backlog[1] / calls:.1f} calls per decision"
            )
    placement.PlacementRule.start = start


if __name__ == "__main__":
    main()
