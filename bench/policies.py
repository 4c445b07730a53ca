#!/usr/bin/env python3
"""The core's cost per decision for each policy, side by side, at a fleet's scale.

One worker with --batch running sequences reports every iteration (one token each;
sequences finish at their max_new_tokens and are replaced by admissions), while
clients keep --queued sequences queued (prompts of 64-512 tokens, output 32-256 tokens,
priorities -1..2, 8 tenants). Only `Scheduler.select_batch` is timed, in process; the
worker's own bookkeeping and the submissions between calls are not. Times are the
thread's CPU time (time.thread_time), so other jobs on a shared machine do not inflate
them; on a machine of its own the wall time of a call is the same.

Then, for the queue itself: GetSequence of a queued sequence at --positions queued
(fifo and fair orders), and the memory a queued 4,000-token prompt costs the core,
next to what the same prompt cost as a tuple of Python ints (how the core held it
before). Last, the decisions' quality for tenants: a steady tenant (2 queued) against a
flooding one (20 queued), equal weights, honest worker; the steady tenant's share of the
tokens served over every window of 150 decisions, per policy and seed.

    .venv/bin/python -m bench.policies
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
import tracemalloc

from common.loadgen import percentile
from service.core import (
    FinishedSequence,
    FinishReason,
    Scheduler,
    SchedulerConfig,
    SequenceState,
    SubmitParams,
    TokenUpdate,
    WorkerRegistration,
    WorkerReport,
)
from service.core.errors import DeadlineUnreachable

POLICIES = ("fifo", "budget", "fair")


def _params(rnd: random.Random) -> SubmitParams:
    prompt_len = rnd.randint(64, 512)
    return SubmitParams(
        prompt_token_ids=[rnd.randrange(1, 150_000) for _ in range(prompt_len)],
        max_new_tokens=rnd.randint(32, 256),
        priority=rnd.choice((-1, 0, 0, 1, 2)),
        tenant=f"tenant-{rnd.randrange(8)}",
    )


def bench_decisions(
    policy: str, batch: int, queued: int, iterations: int, seed: int, targets: bool = False
) -> list[float]:
    """`targets`: --tpot-target-ms 100 and --ttft-target-ms 2000, the worker reporting
    each step's time (20 ms + 20 us a prefill token + 0.1 ms a decode)."""
    rnd = random.Random(seed)
    latency = dict(tpot_target_ms=100.0, ttft_target_ms=2000.0) if targets else {}
    config = SchedulerConfig(
        policy=policy,
        max_batch_size=batch,
        chunk_size=512,
        max_num_batched_tokens=4096,
        max_queue=queued + batch,
        lease_ttl_ms=3_600_000,
        **latency,
    )  # slow fills keep the lease
    core = Scheduler(config)
    pool = [_params(rnd) for _ in range(256)]  # reused: building prompts is not timed
    core.register_worker(
        WorkerRegistration(
            "bench", total_kv_pages=10**6, page_size=16, total_gdn_slots=batch, max_batch_size=batch
        )
    )
    for i in range(queued):
        _offer(core, pool[i % len(pool)])  # with a TTFT target, the fleet sheds some
    waiting: dict[int, tuple[int, int]] = {}  # seq_id -> (prompt length, tokens to generate)
    running: dict[int, int] = {}  # seq_id -> tokens left to generate
    finished: list[FinishedSequence] = []
    tokens: list[TokenUpdate] = []
    samples = []
    step_us = 0
    for i in range(iterations):
        report = WorkerReport(
            "bench",
            waiting=tuple(waiting),
            running=tuple(running),
            kv_free_pages=10**6 // 2,
            gdn_free_slots=batch - len(waiting) - len(running),
            finished=tuple(finished),
            tokens=tuple(tokens),
            last_step_us=step_us if targets else 0,
        )
        started = time.thread_time()
        decision = core.select_batch(report)
        samples.append(time.thread_time() - started)
        finished, tokens = [], []
        step_us = (
            20_000 + 20 * sum(c.chunk_len for c in decision.prefill) + 100 * len(decision.decode)
        )
        for chunk in decision.prefill:
            if chunk.spec is not None:
                waiting[chunk.seq_id] = (
                    len(chunk.spec.prompt_token_ids),
                    chunk.spec.max_new_tokens,
                )
            total, left = waiting[chunk.seq_id]
            if chunk.chunk_start + chunk.chunk_len >= total:
                del waiting[chunk.seq_id]
                running[chunk.seq_id] = left
        for seq_id in decision.preempt:
            running.pop(seq_id, None)
            waiting.pop(seq_id, None)
        for seq_id in decision.decode:
            running[seq_id] -= 1
            tokens.append(TokenUpdate(seq_id, (7,)))
            if running[seq_id] == 0:
                del running[seq_id]
                finished.append(FinishedSequence(seq_id, FinishReason.MAX_LENGTH))
        offered = i
        while core.status().queue_depth < queued:
            if not _offer(core, pool[offered % len(pool)]):
                offered += 1  # shed: offer the next one
    return samples


def _offer(core: Scheduler, params: SubmitParams) -> bool:
    """Submit; False if shed (with a TTFT target, a priority -1 request may be)."""
    try:
        core.submit(params)
    except DeadlineUnreachable:
        return False
    return True


def bench_get_sequence(policy: str, positions: int, calls: int, seed: int) -> list[float]:
    rnd = random.Random(seed)
    core = Scheduler(SchedulerConfig(policy=policy, max_queue=positions))
    prompt = list(range(1, 65))
    ids = [
        core.submit(
            SubmitParams(
                prompt_token_ids=prompt,
                max_new_tokens=8,
                priority=rnd.choice((-1, 0, 1)),
                tenant=f"tenant-{rnd.randrange(8)}",
            )
        ).seq_id
        for _ in range(positions)
    ]
    samples = []
    for _ in range(calls):
        seq_id = rnd.choice(ids)
        started = time.thread_time()
        core.get_sequence(seq_id)
        samples.append(time.thread_time() - started)
    return samples


def bytes_per_queued_prompt(prompt_len: int, count: int) -> tuple[float, float]:
    """(the core's bytes per queued sequence, a tuple of Python ints' bytes per prompt)."""
    rnd = random.Random(1)
    prompts = [[rnd.randrange(1_000, 150_000) for _ in range(prompt_len)] for _ in range(count)]
    core = Scheduler(SchedulerConfig(max_seq_len=prompt_len + 8, max_queue=count))
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for prompt in prompts:
        core.submit(SubmitParams(prompt_token_ids=prompt, max_new_tokens=8))
    core_bytes = (tracemalloc.get_traced_memory()[0] - before) / count
    # As a tuple of ints, the way a protobuf repeated field converts by default.
    before = tracemalloc.get_traced_memory()[0]
    as_tuples = [tuple(int(str(t)) for t in prompt) for prompt in prompts]
    tuple_bytes = (tracemalloc.get_traced_memory()[0] - before) / count
    tracemalloc.stop()
    del as_tuples
    return core_bytes, tuple_bytes


def tenant_shares(
    policy: str, seed: int, decisions: int = 600, window: int = 150
) -> tuple[float, float]:
    """(lowest, mean) share of the steady tenant over the windows of `window` decisions."""
    from bench.harness.honest_worker import HonestWorker, Served

    rnd = random.Random(seed)
    served = Served()
    core = Scheduler(
        SchedulerConfig(
            policy=policy,
            max_batch_size=8,
            chunk_size=16,
            max_seq_len=64,
            max_num_batched_tokens=64,
            min_prefill_chunk=4,
            max_queue=10**6,
        ),
        observer=served,
    )
    core.register_worker(
        WorkerRegistration(
            "w0", total_kv_pages=10**4, page_size=16, total_gdn_slots=8, max_batch_size=8
        )
    )
    worker = HonestWorker("w0", 10**4, 16, 8)
    queued: dict[str, list[int]] = {"flood": [], "steady": []}
    target = {"flood": 20, "steady": 2}
    history = []
    for _ in range(decisions):
        for tenant, ids in queued.items():
            ids[:] = [s for s in ids if core.get_sequence(s).state is SequenceState.QUEUED]
            while len(ids) < target[tenant]:
                prompt_len = rnd.randint(4, 24)
                ids.append(
                    core.submit(
                        SubmitParams(
                            prompt_token_ids=list(range(1, prompt_len + 1)),
                            max_new_tokens=rnd.randint(1, 24),
                            tenant=tenant,
                        )
                    ).seq_id
                )
        before = dict(served.tokens)
        worker.execute(core.select_batch(worker.report()))
        history.append({t: served.tokens.get(t, 0) - before.get(t, 0) for t in target})
    shares = []
    for start in range(0, decisions - window + 1, 10):
        steady = sum(h["steady"] for h in history[start : start + window])
        total = steady + sum(h["flood"] for h in history[start : start + window])
        shares.append(steady / total)
    return min(shares), statistics.fmean(shares)


def _us(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered) * 1e6, percentile(ordered, 99) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.policies", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--batch", type=int, default=256, help="running sequences (256)")
    parser.add_argument("--queued", type=int, default=10_000, help="queued sequences (10,000)")
    parser.add_argument("--iterations", type=int, default=2000, help="decisions timed (2000)")
    parser.add_argument(
        "--positions",
        type=int,
        default=100_000,
        help="queued sequences for the GetSequence row (100,000)",
    )
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    print(
        f"Decisions: 1 worker, {args.batch} running, {args.queued} queued, "
        f"{args.iterations} decisions per policy (Scheduler.select_batch only)"
    )
    print(f"{'policy':<10}{'median us':>12}{'p99 us':>12}{'x fifo (median)':>18}  (CPU time)")
    fifo_median = None
    for policy in POLICIES:
        median, p99 = _us(
            bench_decisions(policy, args.batch, args.queued, args.iterations, args.seed)
        )
        fifo_median = fifo_median or median
        print(f"{policy:<10}{median:>12.1f}{p99:>12.1f}{median / fifo_median:>18.2f}")
    print(
        "With --tpot-target-ms 100 --ttft-target-ms 2000 (a learned budget, the deadline "
        "order), against the same policy without:"
    )
    for policy in ("budget", "fair"):
        off, _ = _us(bench_decisions(policy, args.batch, args.queued, args.iterations, args.seed))
        median, p99 = _us(
            bench_decisions(
                policy, args.batch, args.queued, args.iterations, args.seed, targets=True
            )
        )
        print(
            f"{policy + ' +T':<10}{median:>12.1f}{p99:>12.1f}{median / fifo_median:>18.2f}"
            f"  ({median / off:.2f} x {policy} without targets, {off:.1f} us)"
        )

    print(f"\nGetSequence of a queued sequence, {args.positions} queued (1,000 calls)")
    print(f"{'order':<10}{'median us':>12}{'p99 us':>12}  (CPU time)")
    for policy in ("fifo", "fair"):
        median, p99 = _us(bench_get_sequence(policy, args.positions, 1000, args.seed))
        print(f"{policy:<10}{median:>12.1f}{p99:>12.1f}")

    core_bytes, tuple_bytes = bytes_per_queued_prompt(4000, 200)
    print("\nMemory per queued 4,000-token prompt (tracemalloc, 200 sequences)")
    print(f"{'the core (array of uint32)':<34}{core_bytes / 1024:>8.1f} KiB")
    print(f"{'a tuple of Python ints':<34}{tuple_bytes / 1024:>8.1f} KiB")

    print(
        "\nSteady tenant's share of served tokens against a flooding tenant "
        "(windows of 150 decisions; lowest / mean)"
    )
    for policy in POLICIES:
        cells = [tenant_shares(policy, seed) for seed in (1, 2, 3)]
        print(f"{policy:<10}" + "".join(f"{low:>8.3f} /{mean:>6.3f}" for low, mean in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
