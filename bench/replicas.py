#!/usr/bin/env python3
"""Replicas on PostgreSQL beside one scheduler on SQLite: decisions/s, SelectBatch latency,
CPU per decision, and database round trips per decision and per Submit.

Each configuration runs real `lattice-scheduler serve` processes on loopback:
  sqlite       one scheduler, --state-dir (the embedded default)
  postgres-1   one replica, --state postgresql://... (a private cluster, fsync on)
  postgres-2   two replicas on the same database
Load, the same for each: --sequences queued by Submit (timed: p50 of a Submit), then
--workers fake workers (threads here, spread over the replicas) that each hold up to
--batch sequences, report one token per running sequence per call, and finish a sequence
after --new-tokens tokens, for --seconds. A decision is one answered SelectBatch.

CPU per decision: CPU seconds of the scheduler processes, and of the PostgreSQL server
(postmaster and its backends), over the timed window, divided by decisions. On a shared
2-core machine, read cost, not scaling: two replicas share the same two cores.

    .venv/bin/python -m bench.replicas --seconds 15
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench.harness.processes import ROOT, cpu_seconds, scrape
from bench.harness.tables import print_table
from common.loadgen import percentile
from common.processes import spawn_scheduler
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from service.state.pg_cluster import PrivateCluster, free_port


@dataclass
class Result:
    name: str
    decisions: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    submit_latencies: list[float] = field(default_factory=list)
    scheduler_cpu: float = 0.0
    database_cpu: float = 0.0
    round_trips: dict[str, float] = field(default_factory=dict)
    submits: int = 0
    claimed: float = 0.0
    tokens: float = 0.0


def database_pids(cluster: PrivateCluster) -> list[int]:
    postmaster = int((cluster.data_dir / "postmaster.pid").read_text().split()[0])
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            if ppid == postmaster:
                children.append(int(entry.name))
    return [postmaster, *children]


def start_scheduler(state: list[str], directory: Path, name: str):
    """(Popen, target, metrics port) of a scheduler that printed its banner."""
    process = spawn_scheduler(
        name,
        directory,
        "--policy",
        "fifo",
        "--lease-ttl-ms",
        "30000",
        *state,
        port=free_port(),
        cwd=ROOT,
    )
    return process.popen, f"127.0.0.1:{process.ports[0]}", process.ports[1]


def worker_thread(
    stub,
    worker_id: str,
    batch: int,
    new_tokens: int,
    stop: threading.Event,
    started: threading.Event,
    latencies: list[float],
    counts: list[int],
) -> None:
    stub.RegisterWorker(
        pb.RegisterWorkerRequest(
            worker_id=worker_id,
            total_kv_pages=1_000_000,
            page_size=16,
            total_gdn_slots=batch,
            max_batch_size=batch,
        ),
        timeout=10,
    )
    generated: dict[int, int] = {}
    running: list[int] = []
    waiting: list[int] = []
    while not stop.is_set():
        tokens, finished = [], []
        for seq_id in running:
            generated[seq_id] += 1
            if generated[seq_id] >= new_tokens:
                finished.append(
                    pb.FinishedSequence(
                        seq_id=seq_id,
                        reason=pb.FINISH_REASON_MAX_LENGTH,
                        generated_tokens=generated[seq_id],
                    )
                )
            tokens.append(
                pb.TokenUpdate(seq_id=seq_id, token_ids=[7], offset=generated[seq_id] - 1)
            )
        done = {f.seq_id for f in finished}
        running = [s for s in running if s not in done] + waiting
        waiting = []
        request = pb.SelectBatchRequest(
            worker_id=worker_id,
            running=[s for s in running],
            tokens=tokens,
            finished=finished,
            kv_free_pages=1_000_000,
            gdn_free_slots=batch - len(running),
        )
        t0 = time.perf_counter()
        decision = stub.SelectBatch(request, timeout=30)
        elapsed = time.perf_counter() - t0
        if started.is_set():
            latencies.append(elapsed)
            counts[0] += 1
        for seq_id in decision.evict:
            if seq_id in running:
                running.remove(seq_id)
        for chunk in decision.prefill:
            if chunk.HasField("spec"):
                generated[chunk.seq_id] = 0
                waiting.append(chunk.seq_id)  # one chunk holds the whole prompt here


def run(
    name: str, targets: list[tuple[str, int]], procs, cluster: PrivateCluster | None, args
) -> Result:
    result = Result(name)
    channels = [grpc.insecure_channel(t) for t, _ in targets]
    stubs = [pb_grpc.SchedulerStub(c) for c in channels]
    prompt = list(range(1, 33))
    before = [scrape(m) for _, m in targets]
    for i in range(args.sequences):
        t0 = time.perf_counter()
        stubs[i % len(stubs)].Submit(
            pb.SubmitRequest(
                prompt_token_ids=prompt, max_new_tokens=args.new_tokens, request_id=f"{name}-{i}"
            ),
            timeout=10,
        )
        result.submit_latencies.append(time.perf_counter() - t0)
    result.submit_latencies.sort()
    after_submit = [scrape(m) for _, m in targets]
    result.submits = args.sequences
    result.round_trips["submit"] = sum(
        a.get(("lattice_scheduler_database_round_trips_total", (("purpose", "submit"),)), 0)
        - b.get(("lattice_scheduler_database_round_trips_total", (("purpose", "submit"),)), 0)
        for a, b in zip(after_submit, before)
    )

    stop, started = threading.Event(), threading.Event()
    latencies: list[list[float]] = [[] for _ in range(args.workers)]
    counts = [[0] for _ in range(args.workers)]
    threads = [
        threading.Thread(
            target=worker_thread,
            args=(
                stubs[i % len(stubs)],
                f"bench-{i}",
                args.batch,
                args.new_tokens,
                stop,
                started,
                latencies[i],
                counts[i],
            ),
            daemon=True,
        )
        for i in range(args.workers)
    ]
    for t in threads:
        t.start()
    time.sleep(args.warmup)
    pids = [p.pid for p in procs]
    db_pids = database_pids(cluster) if cluster else []
    start_metrics = [scrape(m) for _, m in targets]
    cpu0, db0, t0 = cpu_seconds(pids), cpu_seconds(db_pids), time.monotonic()
    started.set()
    time.sleep(args.seconds)
    started.clear()
    cpu1 = cpu_seconds(pids)
    db1 = cpu_seconds(database_pids(cluster) if cluster else [])
    result.seconds = time.monotonic() - t0
    end_metrics = [scrape(m) for _, m in targets]
    stop.set()
    for t in threads:
        t.join(30)
    result.decisions = sum(c[0] for c in counts)
    result.latencies = sorted(x for ls in latencies for x in ls)
    result.scheduler_cpu, result.database_cpu = cpu1 - cpu0, max(0.0, db1 - db0)
    tokens = ("lattice_scheduler_generation_tokens_total", ())
    result.tokens = sum(
        e.get(tokens, 0) - s.get(tokens, 0) for e, s in zip(end_metrics, start_metrics)
    )
    for purpose in ("save", "claim"):
        key = ("lattice_scheduler_database_round_trips_total", (("purpose", purpose),))
        result.round_trips[purpose] = sum(
            e.get(key, 0) - s.get(key, 0) for e, s in zip(end_metrics, start_metrics)
        )
    for channel in channels:
        channel.close()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.replicas", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--seconds", type=float, default=15.0, help="timed window per run")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="sequences per worker")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument(
        "--sequences",
        type=int,
        default=3000,
        help="queued up front (enough to keep every worker full)",
    )
    parser.add_argument("--only", choices=("sqlite", "postgres-1", "postgres-2"))
    args = parser.parse_args()

    directory = Path(tempfile.mkdtemp(prefix="lattice-bench-replicas-"))
    os.chmod(directory, 0o755)
    results = []
    for name in ("sqlite", "postgres-1", "postgres-2"):
        if args.only and name != args.only:
            continue
        cluster, procs = None, []
        try:
            if name == "sqlite":
                state = [["--state-dir", str(directory / "sqlite")]]
            else:
                cluster = PrivateCluster(directory / f"pg-{name}").start()
                state = [["--state", cluster.url]] * int(name[-1])
            started = [start_scheduler(s, directory, f"{name}-{i}") for i, s in enumerate(state)]
            procs = [p for p, _, _ in started]
            print(f"{name}: running ({len(procs)} scheduler process(es))...", flush=True)
            results.append(run(name, [(t, m) for _, t, m in started], procs, cluster, args))
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
            if cluster is not None:
                cluster.destroy()
    print(
        f"\n{args.workers} workers x {args.batch} sequences, {args.new_tokens} tokens each, "
        f"{args.seconds:g} s timed; load average {os.getloadavg()[0]:.1f} "
        f"on {os.cpu_count()} cores\n"
    )
    print_table(
        [
            "config",
            "decisions/s",
            "p50 ms",
            "p99 ms",
            "sched CPU ms/dec",
            "db CPU ms/dec",
            "RT/dec",
            "RT/submit",
            "submit p50 ms",
            "tokens/dec",
        ],
        [_row(r) for r in results],
    )
    print(f"\nlogs in {directory}")
    return 0


def _row(r: Result) -> list[str]:
    decisions = max(1, r.decisions)
    round_trips = r.round_trips.get("save", 0) + r.round_trips.get("claim", 0)
    return [
        r.name,
        f"{r.decisions / r.seconds:.0f}",
        f"{percentile(r.latencies, 50) * 1000:.2f}",
        f"{percentile(r.latencies, 99) * 1000:.2f}",
        f"{r.scheduler_cpu / decisions * 1000:.2f}",
        f"{r.database_cpu / decisions * 1000:.2f}",
        f"{round_trips / decisions:.2f}",
        f"{r.round_trips.get('submit', 0) / max(1, r.submits):.2f}",
        f"{percentile(r.submit_latencies, 50) * 1000:.2f}",
        f"{r.tokens / decisions:.1f}",
    ]


if __name__ == "__main__":
    sys.exit(main())
