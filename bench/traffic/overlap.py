"""Scripted workers with a step time (`overlap`): tokens/s with the worker's report
overlapped with its step, and in turn."""

from __future__ import annotations

import time

import grpc

from bench.harness.fake_worker import PROMPT, RPC_TIMEOUT
from bench.harness.processes import (
    start_scheduler,
    start_scripted_workers,
    stop_all,
    wait_for_workers,
)
from bench.harness.tables import load_note, print_table
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc


def _overlap_run(args, overlap: bool) -> tuple[float, float, int]:
    scheduler = start_scheduler("--max-batch-size", str(args.batch))
    flags = [
        "--step-ms",
        str(args.step_ms),
        "--max-batch-size",
        str(args.batch),
        "--gdn-slots",
        str(args.batch),
        "--kv-pages",
        "100000",
    ]
    workers = start_scripted_workers(
        scheduler, args.workers, *flags, *([] if overlap else ["--no-overlap"])
    )
    try:
        channel = grpc.insecure_channel(scheduler.target)
        stub = pb_grpc.SchedulerStub(channel)
        wait_for_workers(stub, args.workers)
        request = pb.SubmitRequest(prompt_token_ids=PROMPT, max_new_tokens=args.max_new_tokens)
        total = args.workers * args.batch
        for _ in range(total):
            stub.Submit(request, timeout=RPC_TIMEOUT)
        # Steady state: every worker full and decoding; measure the middle of the run.
        time.sleep(args.max_new_tokens * args.step_ms / 1000 * 0.2)
        tokens_0, at_0 = (
            scheduler.metric("lattice_scheduler_generation_tokens_total"),
            time.perf_counter(),
        )
        time.sleep(args.max_new_tokens * args.step_ms / 1000 * 0.5)
        tokens_1, at_1 = (
            scheduler.metric("lattice_scheduler_generation_tokens_total"),
            time.perf_counter(),
        )
        while (
            stub.GetStatus(pb.GetStatusRequest(), timeout=10).queue_depth
            or scheduler.metric("lattice_scheduler_finished_total") < total
        ):
            time.sleep(0.1)
        channel.close()
        return (tokens_1 - tokens_0) / (at_1 - at_0), at_1 - at_0, int(tokens_1 - tokens_0)
    finally:
        stop_all(*workers, scheduler.proc)


def cmd_overlap(args) -> None:
    ideal = args.workers * args.batch / (args.step_ms / 1000)
    print(
        f"{args.workers} scripted worker processes, --step-ms {args.step_ms:g}, "
        f"{args.batch} sequences each ({args.max_new_tokens} new tokens); steady-state "
        f"tokens/s from the scheduler's generation_tokens_total over the middle half of "
        f"the run; engine-only ideal: {args.workers} x {args.batch} tokens every "
        f"{args.step_ms:g} ms = {ideal:.0f} tokens/s {load_note()}"
    )
    rows = []
    for label, overlap in (("in turn (--no-overlap)", False), ("overlapped (default)", True)):
        rate, seconds, tokens = _overlap_run(args, overlap)
        rows.append([label, tokens, f"{seconds:.2f}", f"{rate:.0f}", f"{rate / ideal:.2f}"])
    print_table(["", "tokens measured", "over s", "tokens/s", "vs ideal"], rows)
