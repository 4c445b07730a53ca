#!/usr/bin/env python3
"""SelectBatch latency: over gRPC on loopback, next to the in-process decision.

Set-up (the same for both): submit --sequences sequences, register one worker with
max_batch_size = --batch and a GDN slot for each, let it admit --batch of them, then
every timed iteration it reports all --batch in `running` (the rest stay queued, so
each decision also checks admission and finds the batch full).

    python -m bench.select_batch --iterations 2000

Rows:
  grpc round trip      client-side time of one SelectBatch on 127.0.0.1
  in-process convert   convert.worker_report + core.select_batch + convert.decision
  in-process core      core.select_batch with the same report, nothing else
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import grpc
from prometheus_client import CollectorRegistry

from common.loadgen import percentile
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from service.core import Scheduler, SchedulerConfig
from service.server import convert
from service.server.app import start
from service.server.metrics import SchedulerMetrics
from service.settings import ServeSettings

WORKER_ID = "bench"
PROMPT = list(range(1, 129))
KV_PAGES = 100_000


def _submit_request() -> pb.SubmitRequest:
    return pb.SubmitRequest(prompt_token_ids=PROMPT, max_new_tokens=256)


def _register_request(batch: int) -> pb.RegisterWorkerRequest:
    return pb.RegisterWorkerRequest(
        worker_id=WORKER_ID,
        total_kv_pages=KV_PAGES,
        page_size=16,
        total_gdn_slots=batch,
        max_batch_size=batch,
    )


def _report(running: list[int], gdn_free_slots: int) -> pb.SelectBatchRequest:
    return pb.SelectBatchRequest(
        worker_id=WORKER_ID,
        running=running,
        kv_free_pages=KV_PAGES // 2,
        gdn_free_slots=gdn_free_slots,
    )


def _time(call: Callable[[], object], warmup: int, iterations: int) -> list[float]:
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(iterations):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return samples


def _check(decision: pb.SchedulerDecision, running: list[int]) -> None:
    if list(decision.decode) != running or decision.prefill or decision.evict:
        raise SystemExit("benchmark set-up is wrong: the decision is not 'decode all, admit none'")


def bench_grpc(
    config: SchedulerConfig, sequences: int, batch: int, warmup: int, iterations: int
) -> list[float]:
    running_server = start(
        ServeSettings(host="127.0.0.1", port=0, metrics_port=0, scheduler=config),
        CollectorRegistry(),
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{running_server.port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=10)
        stub = pb_grpc.SchedulerStub(channel)
        for _ in range(sequences):
            stub.Submit(_submit_request(), timeout=10)
        stub.RegisterWorker(_register_request(batch), timeout=10)
        first = stub.SelectBatch(_report([], gdn_free_slots=batch), timeout=10)
        running = [c.seq_id for c in first.prefill]
        if len(running) != batch:
            raise SystemExit(f"admitted {len(running)} sequences, expected {batch}")
        request = _report(running, gdn_free_slots=0)
        _check(stub.SelectBatch(request, timeout=10), running)
        return _time(lambda: stub.SelectBatch(request, timeout=10), warmup, iterations)
    finally:
        channel.close()
        running_server.stop(0)


def bench_in_process(
    config: SchedulerConfig, sequences: int, batch: int, warmup: int, iterations: int
) -> tuple[list[float], list[float]]:
    # The same observer the server uses, so the core does the same work in both.
    core = Scheduler(config, observer=SchedulerMetrics(CollectorRegistry()))
    for _ in range(sequences):
        core.submit(convert.submit_params(_submit_request()))
    core.register_worker(convert.worker_registration(_register_request(batch)))
    first = core.select_batch(convert.worker_report(_report([], gdn_free_slots=batch)))
    running = [c.seq_id for c in first.prefill]
    request = _report(running, gdn_free_slots=0)
    report = convert.worker_report(request)
    _check(convert.decision(core.select_batch(report)), running)
    with_convert = _time(
        lambda: convert.decision(core.select_batch(convert.worker_report(request))),
        warmup,
        iterations,
    )
    core_only = _time(lambda: core.select_batch(report), warmup, iterations)
    return with_convert, core_only


def _row(name: str, samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = percentile(ordered, 99)
    us = 1e6
    return (
        f"{name:<22}{len(samples):>8}{statistics.median(ordered) * us:>12.1f}"
        f"{p99 * us:>12.1f}{statistics.fmean(ordered) * us:>12.1f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.select_batch", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--iterations",
        type=int,
        default=2000,
        help="timed SelectBatch calls per row (default 2000)",
    )
    parser.add_argument(
        "--warmup", type=int, default=200, help="untimed calls before each row (default 200)"
    )
    parser.add_argument(
        "--batch", type=int, default=256, help="sequences the worker reports running (default 256)"
    )
    parser.add_argument(
        "--sequences",
        type=int,
        default=320,
        help="sequences submitted; those beyond --batch stay queued (default 320)",
    )
    args = parser.parse_args()
    if args.iterations < 1 or args.batch < 1 or args.sequences < args.batch:
        parser.error("need --iterations >= 1, --batch >= 1 and --sequences >= --batch")

    config = SchedulerConfig(max_batch_size=args.batch, max_queue=max(args.sequences, 1))
    grpc_samples = bench_grpc(config, args.sequences, args.batch, args.warmup, args.iterations)
    with_convert, core_only = bench_in_process(
        config, args.sequences, args.batch, args.warmup, args.iterations
    )

    print(
        f"SelectBatch, 1 worker reporting {args.batch} running, "
        f"{args.sequences - args.batch} queued; {args.warmup} warm-up calls per row"
    )
    print(f"{'':<22}{'calls':>8}{'median us':>12}{'p99 us':>12}{'mean us':>12}")
    print(_row("grpc round trip", grpc_samples))
    print(_row("in-process convert", with_convert))
    print(_row("in-process core", core_only))
    overhead = statistics.median(grpc_samples) - statistics.median(core_only)
    print(f"gRPC + conversion overhead (median): {overhead * 1e6:.1f} us per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
