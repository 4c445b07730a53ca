#!/usr/bin/env python3
"""What durable state costs: Submit and SelectBatch in the core, without a store and with
SQLite under each --state-fsync mode; then how long a restart takes to load the state.

    python -m bench.state_store --iterations 1000

SelectBatch here is a decode iteration: one worker reports --batch running sequences,
each with one new token, so every call saves --batch token rows. Submit saves one new
sequence (fsync'd under `acks` and `always`). The state dir is a temporary directory on
the disk that holds --tmp-dir (default: the system's temporary directory).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

from common.loadgen import percentile
from service.core import (
    Scheduler,
    SchedulerConfig,
    SubmitParams,
    TokenUpdate,
    WorkerRegistration,
    WorkerReport,
)
from service.state.sqlite import FSYNC_MODES, SqliteStateStore

PROMPT = tuple(range(1, 129))


def _params(i: int) -> SubmitParams:
    return SubmitParams(prompt_token_ids=PROMPT, max_new_tokens=3900, request_id=f"r{i}")


def _time(call: Callable[[int], object], count: int) -> list[float]:
    samples = []
    for i in range(count):
        started = time.perf_counter()
        call(i)
        samples.append(time.perf_counter() - started)
    return samples


def bench(store, batch: int, iterations: int, submits: int):
    config = SchedulerConfig(max_batch_size=batch, max_queue=batch + submits + 1)
    core = Scheduler(config, store=store)
    for i in range(batch):
        core.submit(_params(-1 - i))
    core.register_worker(WorkerRegistration("bench", 100_000, 16, batch, batch))
    running = tuple(
        c.seq_id
        for c in core.select_batch(
            WorkerReport("bench", kv_free_pages=50_000, gdn_free_slots=batch)
        ).prefill
    )
    assert len(running) == batch

    def decode(i: int) -> None:
        tokens = tuple(TokenUpdate(s, (i % 1000,)) for s in running)
        decision = core.select_batch(
            WorkerReport(
                "bench", running=running, tokens=tokens, kv_free_pages=50_000, gdn_free_slots=0
            )
        )
        assert len(decision.decode) == batch and not decision.prefill

    select = _time(decode, iterations)
    submit = _time(lambda i: core.submit(_params(i)), submits)
    return select, submit


def _stats(samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = percentile(ordered, 99)
    return f"{statistics.median(ordered) * 1e6:>10.0f}{p99 * 1e6:>10.0f}"


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.state_store", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--iterations", type=int, default=1000, help="timed SelectBatch calls")
    parser.add_argument("--submits", type=int, default=500, help="timed Submit calls")
    parser.add_argument("--batch", type=int, default=256, help="running sequences per call")
    parser.add_argument("--tmp-dir", default=None, help="where the state dirs go")
    args = parser.parse_args()

    print(
        f"core calls, 1 worker, {args.batch} running with 1 token each per SelectBatch; "
        f"{args.iterations} SelectBatch and {args.submits} Submit calls per row"
    )
    print(
        f"{'store':<18}{'SelectBatch median us':>24}{'p99 us':>10}"
        f"{'Submit median us':>20}{'p99 us':>10}"
    )
    rows = [("none (memory)", None)] + [(f"sqlite {mode}", mode) for mode in FSYNC_MODES]
    last_dir = None
    for name, mode in rows:
        with tempfile.TemporaryDirectory(dir=args.tmp_dir) as state_dir:
            store = SqliteStateStore(state_dir, mode) if mode else None
            select, submit = bench(store, args.batch, args.iterations, args.submits)
            print(f"{name:<18}{'':>4}{_stats(select)}{'':>10}{_stats(submit)}", flush=True)
            if store is not None:
                store.close()
            if mode == "acks":
                # Load the state this row left: how long a restart takes to carry on.
                started = time.perf_counter()
                restarted_store = SqliteStateStore(state_dir, mode)
                restarted = Scheduler(
                    SchedulerConfig(
                        max_batch_size=args.batch, max_queue=args.batch + args.submits + 1
                    ),
                    store=restarted_store,
                )
                elapsed = time.perf_counter() - started
                status = restarted.status()
                last_dir = (
                    elapsed,
                    status.queue_depth,
                    status.num_assigned,
                    args.batch * args.iterations,
                )
                restarted_store.close()
    if last_dir:
        elapsed, queued, assigned, tokens = last_dir
        print(
            f"restart (sqlite acks state): loaded {queued} queued and {assigned} assigned "
            f"sequences with {tokens} generated tokens in {elapsed * 1000:.0f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
