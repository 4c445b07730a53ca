"""Acknowledged Submits/s (`submits`): concurrent submitters against each fsync mode of
--state-dir, and without one."""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from bench.harness.fake_worker import PROMPT, RPC_TIMEOUT, channels, close_all
from bench.harness.processes import ROOT, checkouts, start_scheduler
from bench.harness.tables import load_note, ms, pct, print_table
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc


async def _submits(target: str, submitters: int, seconds: float) -> tuple[int, list[float]]:
    chans = channels(target, 2)
    request = pb.SubmitRequest(prompt_token_ids=PROMPT, max_new_tokens=4)
    latencies: list[float] = []
    end = time.perf_counter() + seconds

    async def one(i: int) -> None:
        stub = pb_grpc.SchedulerStub(chans[i % len(chans)])
        while time.perf_counter() < end:
            started = time.perf_counter()
            await stub.Submit(request, timeout=RPC_TIMEOUT)
            latencies.append(time.perf_counter() - started)

    await asyncio.gather(*(one(i) for i in range(submitters)))
    await close_all(chans=chans)
    return len(latencies), latencies


def cmd_submits(args) -> None:
    tmp_root = Path(args.tmp_dir).resolve()
    tmp_root.mkdir(parents=True, exist_ok=True)
    print(
        f"acknowledged Submits/s: {args.submitters} concurrent submitters for "
        f"{args.seconds:g} s, --state-dir on {tmp_root} (ext4 here) {load_note()}"
    )
    rows = []
    runs = [(label, root, fsync) for label, root in checkouts(args.before) for fsync in ("acks",)]
    runs += [("this scheduler", ROOT, "never"), ("this scheduler, no --state-dir", ROOT, "")]
    for label, root, fsync in runs:
        with tempfile.TemporaryDirectory(dir=tmp_root) as state:
            flags = ("--state-dir", state, "--state-fsync", fsync) if fsync else ()
            scheduler = start_scheduler("--max-queue", "10000000", *flags, root=root)
            try:
                count, latencies = asyncio.run(
                    _submits(scheduler.target, args.submitters, args.seconds)
                )
                fsyncs = scheduler.metric("lattice_scheduler_state_fsyncs_total")
            finally:
                scheduler.proc.stop()
        rows.append(
            [
                label,
                fsync or "-",
                count,
                f"{count / args.seconds:.0f}",
                ms(statistics.median(latencies)),
                ms(pct(latencies, 99)),
                f"{fsyncs:.0f}" if fsyncs else "-",
            ]
        )
    print_table(["", "fsync", "acknowledged", "per s", "p50 ms", "p99 ms", "fsyncs"], rows)
