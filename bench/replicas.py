#!/usr/bin/env python3
"""Replicas on PostgreSQL beside one scheduler on SQLite: decisions/s, SelectBatch latency,
CPU per decision, and database round trips and commits per decision and per Submit.

Each configuration runs real `lattice-scheduler serve` processes on loopback:
  sqlite       one scheduler, --state-dir (the embedded default)
  sqlite-N     N independent schedulers, each its own --state-dir, the workers spread
               over them: what N processes cost on these cores with nothing shared, the
               fair match for postgres-N on a machine with fewer cores than processes
  postgres-N   N replicas, --state postgresql://... on one private cluster (fsync on),
               a fresh database per run
for each count of fake workers in --workers (4,16,64 by default). Load, the same for
each: workers x batch + --extra-sequences queued by Submit (from 8 threads; p50 of a
Submit), then the fake workers (threads here, spread over the replicas) that each hold
up to --batch sequences, report one token per running sequence per call, and finish a
sequence after --new-tokens tokens, for --seconds. A decision is one answered SelectBatch.
By default a fake worker reports again as soon as it is answered; with --step-ms it first
runs each decision that long (from a random phase), as a real worker steps: how many saves
a group commit gathers, and so what a decision costs PostgreSQL, depends on that pace.

CPU per decision: CPU seconds of the scheduler processes, and of the PostgreSQL server
(postmaster and its backends), over the timed window, divided by decisions. On a shared
2-core machine, read cost, not scaling: the replicas, PostgreSQL and the fake workers
share the same two cores.

    .venv/bin/python -m bench.replicas --seconds 8 --workers 4,16,64
    .venv/bin/python -m bench.replicas --workers 16,64 --step-ms 20   # 50 iterations/s
    .venv/bin/python -m bench.replicas --workers 64 --step-ms 20 --overlap \
        --configs sqlite-4,postgres-4,sqlite   # four replicas against four lone schedulers

With `--statements N`, PostgreSQL's own view of each PostgreSQL configuration's window
as well: its N costliest statements (pg_stat_statements: calls, rows, execution time and
WAL bytes per decision), its CPU by kind of process (client backends, the listeners,
walwriter, ...) and the rows written per table per decision. The extension's hooks cost
a little CPU themselves: take the headline figures from a run without it.

`followups` instead: 16 conversations x 4 turns on scripted workers keeping a prefix
cache, on one scheduler with 4 workers and on 2 replicas with 2 workers each; counts the
follow-up turns that resumed from their conversation's cache (cached_tokens at least the
last turn's prompt less one block).

    .venv/bin/python -m bench.replicas followups

With `--streams`, a client calls Generate for each sequence instead of Submit (the same
8 in flight; "submit p50" is then the time to a stream's first event, its seq_id), the
streams round-robin over the configuration's schedulers, so that with N replicas about
(N-1)/N of them read a sequence another replica owns; each is held open and read through
the window, from a client process of its own (grpc.aio: not the schedulers' or
PostgreSQL's CPU, nor behind the fake workers' GIL). Once the workers stop, each open
stream gets until its count matches its sequence's (GetSequence), then closes; a table
says how they ended, and a stream that errored, ended early or got a wrong count makes an
ERROR line and exit status 1. Replicas' stream settings go through --serve-arg.

    .venv/bin/python -m bench.replicas --workers 4 --configs postgres-2 --streams
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import queue
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench.harness.processes import ROOT, cpu_seconds, cpu_seconds_single_threaded, scrape
from bench.harness.tables import print_table
from common.loadgen import percentile
from common.processes import spawn_scheduler
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from service.state.pg_cluster import PrivateCluster, free_port
from worker_client.step_clock import LateAsk


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
    commits: float = 0.0
    saves_committed: float = 0.0
    workers: int = 0
    submits: int = 0
    claimed: float = 0.0
    tokens: float = 0.0
    # --statements: PostgreSQL's own counts over the timed window (pg_stat_statements,
    # pg_stat_user_tables): where its time goes, by statement and by table.
    statements: list[tuple[int, int, float, int, str]] = field(default_factory=list)
    table_rows: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)
    database_cpu_by_kind: dict[str, float] = field(default_factory=dict)
    # Group commits over the timed window: how many held up to each count of saves
    # (cumulative, by histogram bound), and how their wait for saves ended.
    saves_per_commit: dict[float, float] = field(default_factory=dict)
    gathers: dict[str, float] = field(default_factory=dict)
    # --streams: how each stream ended; of the streams whose sequence a fake worker ran,
    # how many on a replica other than that worker's; the tokens streamed in the window.
    streams: list[StreamEnd] = field(default_factory=list)
    streams_run: int = 0
    streams_elsewhere: int = 0
    streamed: int = 0


@dataclass
class StreamEnd:
    """How one --streams stream ended: its sequence, the replica (index) it was opened
    on, the tokens it got, whether it got its last event, and what was wrong ('' if
    nothing)."""

    seq_id: int
    replica: int
    tokens: int = 0
    finished: bool = False
    problem: str = ""


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
        "--max-queue",
        "100000",
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
    step_seconds: float = 0.0,
    overlap: bool = False,
    ran: set[int] | None = None,
) -> None:
    settings = stub.RegisterWorker(
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
    # A paced worker (--step-ms) runs each decision for step_seconds before it reports,
    # starting at a random phase, as real workers do not call in lockstep; with overlap
    # its step runs while its report is in flight (a worker's default), so it reports
    # again once both are done.
    stop.wait(random.uniform(0.0, step_seconds))
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
                pb.TokenUpdate(seq_id=seq_id, token_ids=[_TOKEN], offset=generated[seq_id] - 1)
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
            # Overlapped, the answer is due when the step ends, less the worker's slack
            # (worker_client/loop.py's _answer_due).
            answer_due_us=max(0, round((step_seconds - _DUE_SLACK_SECONDS) * 1e6))
            if overlap and settings.accepts_answer_due
            else 0,
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
        if step_seconds:
            stop.wait(max(0.0, step_seconds - elapsed) if overlap else step_seconds)
    if ran is not None:  # --streams: which streams were of another replica's sequences
        ran.update(generated)


# What a worker keeps between its answer's due and its step's predicted end.
_DUE_SLACK_SECONDS = LateAsk.slack_seconds
# The token every fake worker generates, every time.
_TOKEN = 7
_PROMPT = list(range(1, 33))


_STATEMENTS = (
    "SELECT calls, rows, total_exec_time, wal_bytes, query FROM pg_stat_statements "
    "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "AND toplevel ORDER BY total_exec_time DESC"
)
_TABLE_ROWS = (
    "SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del FROM pg_stat_user_tables"
)


def _database_cpu_by_kind(url: str, before: dict[int, float], after: dict[int, float]):
    """CPU seconds over the window by kind of PostgreSQL process (pg_stat_activity's
    backend_type; a client backend whose last statement was LISTEN is a listener)."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        kinds = {
            pid: "listener" if (query or "").startswith("LISTEN") else kind
            for pid, kind, query in conn.execute(
                "SELECT pid, backend_type, query FROM pg_stat_activity"
            )
        }
    by_kind: Counter[str] = Counter()
    for pid, cpu in after.items():
        by_kind[kinds.get(pid, "postmaster or gone")] += cpu - before.get(pid, 0.0)
    return dict(by_kind)


def _database_counts(url: str | None, reset: bool):
    """Statements since the last reset (and reset them), and rows written by table."""
    import psycopg

    if url is None:
        return [], {}
    with psycopg.connect(url, autocommit=True) as conn:
        statements = [] if reset else conn.execute(_STATEMENTS).fetchall()
        if reset:
            conn.execute("SELECT pg_stat_statements_reset()")
        conn.execute("SELECT pg_stat_force_next_flush()")
        tables = {row[0]: row[1:] for row in conn.execute(_TABLE_ROWS)}
    return statements, tables


def run(
    name: str,
    targets: list[tuple[str, int]],
    procs,
    cluster: PrivateCluster | None,
    args,
    url: str | None = None,
) -> Result:
    result = Result(name, workers=args.workers)
    channels = [grpc.insecure_channel(t) for t, _ in targets]
    stubs = [pb_grpc.SchedulerStub(c) for c in channels]
    before = [scrape(m) for _, m in targets]
    num_sequences = args.workers * args.batch + args.extra_sequences

    def submit(i: int) -> float:
        t0 = time.perf_counter()
        stubs[i % len(stubs)].Submit(
            pb.SubmitRequest(
                prompt_token_ids=_PROMPT, max_new_tokens=args.new_tokens, request_id=f"{name}-{i}"
            ),
            timeout=30,
        )
        return time.perf_counter() - t0

    client = None
    if args.streams:
        client = StreamClient(name, [t for t, _ in targets], num_sequences, args.new_tokens)
        result.submit_latencies = client.opened()
    else:
        with ThreadPoolExecutor(8) as pool:
            result.submit_latencies = sorted(pool.map(submit, range(num_sequences)))
    after_submit = [scrape(m) for _, m in targets]
    result.submits = num_sequences
    result.round_trips["submit"] = sum(
        a.get(("lattice_scheduler_database_round_trips_total", (("purpose", "submit"),)), 0)
        - b.get(("lattice_scheduler_database_round_trips_total", (("purpose", "submit"),)), 0)
        for a, b in zip(after_submit, before)
    )

    stop, started = threading.Event(), threading.Event()
    latencies: list[list[float]] = [[] for _ in range(args.workers)]
    counts = [[0] for _ in range(args.workers)]
    ran: list[set[int] | None] = [set() if client else None for _ in range(args.workers)]
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
                args.step_ms / 1000,
                args.overlap,
                ran[i],
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
    counted = url if args.statements else None
    _, tables0 = _database_counts(counted, reset=True)
    by_pid0 = {pid: cpu_seconds_single_threaded([pid]) for pid in db_pids}
    streamed0 = client.streamed() if client else 0
    cpu0, db0, t0 = cpu_seconds(pids), cpu_seconds_single_threaded(db_pids), time.monotonic()
    started.set()
    time.sleep(args.seconds)
    started.clear()
    cpu1 = cpu_seconds(pids)
    if client:
        result.streamed = client.streamed() - streamed0
    db1 = cpu_seconds_single_threaded(database_pids(cluster) if cluster else [])
    result.seconds = time.monotonic() - t0
    end_metrics = [scrape(m) for _, m in targets]
    result.statements, tables1 = _database_counts(counted, reset=False)
    if counted:
        by_pid1 = {pid: cpu_seconds_single_threaded([pid]) for pid in database_pids(cluster)}
        result.database_cpu_by_kind = _database_cpu_by_kind(counted, by_pid0, by_pid1)
    result.table_rows = {
        table: tuple(a - b for a, b in zip(rows, tables0.get(table, (0, 0, 0, 0))))
        for table, rows in tables1.items()
    }
    stop.set()
    for t in threads:
        t.join(30)
    if client:
        result.streams = client.close()
        owners = {seq_id: i % len(targets) for i, seq_ids in enumerate(ran) for seq_id in seq_ids}
        served = [e for e in result.streams if e.seq_id in owners]
        result.streams_run = len(served)
        result.streams_elsewhere = sum(owners[e.seq_id] != e.replica for e in served)
    result.decisions = sum(c[0] for c in counts)
    result.latencies = sorted(x for ls in latencies for x in ls)
    result.scheduler_cpu, result.database_cpu = cpu1 - cpu0, max(0.0, db1 - db0)
    tokens = ("lattice_scheduler_generation_tokens_total", ())
    result.tokens = sum(
        e.get(tokens, 0) - s.get(tokens, 0) for e, s in zip(end_metrics, start_metrics)
    )
    for purpose in ("save", "claim", "watch"):
        key = ("lattice_scheduler_database_round_trips_total", (("purpose", purpose),))
        result.round_trips[purpose] = sum(
            e.get(key, 0) - s.get(key, 0) for e, s in zip(end_metrics, start_metrics)
        )
    for attribute, metric in (
        ("commits", "lattice_scheduler_database_commits_total"),
        ("saves_committed", "lattice_scheduler_database_saves_committed_total"),
    ):
        setattr(
            result,
            attribute,
            sum(
                e.get((metric, ()), 0) - s.get((metric, ()), 0)
                for e, s in zip(end_metrics, start_metrics)
            ),
        )
    for e, s in zip(end_metrics, start_metrics):
        for (metric, labels), value in e.items():
            delta = value - s.get((metric, labels), 0)
            if metric == "lattice_scheduler_replica_saves_per_commit_bucket":
                bound = float(dict(labels)["le"])
                result.saves_per_commit[bound] = result.saves_per_commit.get(bound, 0) + delta
            elif metric == "lattice_scheduler_replica_commit_gathers_total":
                outcome = dict(labels)["outcome"]
                result.gathers[outcome] = result.gathers.get(outcome, 0) + delta
    for channel in channels:
        channel.close()
    return result


CONFIGS = ("sqlite", "postgres-1", "postgres-2", "postgres-4")  # the default run
CONFIG_FORMS = "sqlite, sqlite-N, postgres-N (N >= 1)"


def _processes(config: str) -> int | None:
    """The scheduler processes of a configuration (`sqlite` 1, `sqlite-N` and
    `postgres-N` N); None for a name of none of those forms."""
    kind, _, count = config.partition("-")
    if kind == "sqlite" and not count:
        return 1
    if kind in ("sqlite", "postgres") and count.isdigit() and int(count) >= 1:
        return int(count)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.replicas", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--seconds", type=float, default=8.0, help="timed window per run")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--workers", default="4,16,64", help="fake worker counts, comma-separated")
    parser.add_argument("--batch", type=int, default=32, help="sequences per worker")
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the scratch folder (the processes' logs and state) after a run that ends "
        "well; a failed run always keeps it",
    )
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument(
        "--step-ms",
        type=float,
        default=0.0,
        help="each fake worker runs a decision this long before it reports (0: it reports "
        "at once, as fast as the schedulers answer); 20 is a worker at 50 iterations/s",
    )
    parser.add_argument(
        "--overlap",
        action="store_true",
        help="with --step-ms, each step runs while its report is in flight, as a worker "
        "overlaps them by default: the pace is the longer of the step and the answer",
    )
    parser.add_argument(
        "--extra-sequences",
        type=int,
        default=500,
        help="queued up front beyond workers x batch (enough to keep every worker full)",
    )
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), help=f"comma-separated, of {CONFIG_FORMS}"
    )
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="an extra `serve` argument for the replicas (repeat), e.g. "
        "--serve-arg=--replica-commit-wait-ms=1",
    )
    parser.add_argument(
        "--pg-setting",
        action="append",
        default=[],
        help="an extra PostgreSQL server setting NAME=VALUE (repeat), e.g. "
        "--pg-setting=log_min_duration_statement=5",
    )
    parser.add_argument(
        "--statements",
        type=int,
        default=0,
        help="print PostgreSQL's N costliest statements and the rows written per table, "
        "per decision, for each PostgreSQL configuration (pg_stat_statements)",
    )
    parser.add_argument(
        "--streams",
        action="store_true",
        help="submit every sequence by a Generate stream instead of Submit, the streams "
        "round-robin over the schedulers, each read to its end by a client process of its "
        "own; check each got exactly the tokens its sequence generated",
    )
    args = parser.parse_args(argv)
    if not 0 <= args.step_ms <= 10_000:
        parser.error(f"--step-ms must be within 0-10000, got {args.step_ms:g}")
    configs = [c for c in args.configs.split(",") if c]
    for config in configs:
        if _processes(config) is None:
            parser.error(f"unknown config {config!r}: the forms are {CONFIG_FORMS}")
    if args.overlap and not args.step_ms:
        parser.error("--overlap needs --step-ms: a step to overlap the report with")

    directory = Path(tempfile.mkdtemp(prefix="lattice-bench-replicas-"))
    os.chmod(directory, 0o755)
    results = []
    cluster = None
    with _scratch(directory, args.keep):
        try:
            if any(c.startswith("postgres") for c in configs):
                settings = (
                    ("shared_preload_libraries=pg_stat_statements",) if args.statements else ()
                )
                settings += tuple(args.pg_setting)
                cluster = PrivateCluster(directory / "pg", settings=settings).start()
            for num_workers in [int(w) for w in args.workers.split(",")]:
                args.workers = num_workers
                for name in configs:
                    results.append(run_config(name, directory, cluster, args))
                    print(f"  {_progress(results[-1])}", flush=True)
        finally:
            if cluster is not None:
                cluster.stop("immediate")  # its folder (and postgres.log) goes with the scratch
    print(
        f"\n{args.batch} sequences per worker, {args.new_tokens} tokens each, "
        f"steps of {args.step_ms:g} ms{' overlapped' if args.overlap else ''}, "
        f"{args.seconds:g} s timed per run"
        f"{'; submitted by Generate streams' if args.streams else ''}; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n"
    )
    print_table(
        [
            "workers",
            "config",
            "decisions/s",
            "p50 ms",
            "p99 ms",
            "sched CPU ms/dec",
            "db CPU ms/dec",
            "RT/dec",
            "commits/dec",
            "RT/submit",
            "submit p50 ms",
            "tokens/dec",
        ],
        [_row(r) for r in results],
    )
    for r in results:
        if r.commits:  # replicas only
            _print_commits(r)
    for r in results:
        if r.statements:
            _print_statements(r, args.statements)
    if args.streams:
        return _print_streams(results)
    return 0


@contextlib.contextmanager
def _scratch(directory: Path, keep: bool) -> Iterator[None]:
    """Remove `directory` (its state folders hold tens of MB a run) once the block ends
    well, unless `keep`; a failure keeps it and says where, for its logs."""
    try:
        yield
    except BaseException:
        print(f"\nlogs in {directory}", file=sys.stderr)
        raise
    if keep:
        print(f"\nlogs in {directory}")
    else:
        shutil.rmtree(directory, ignore_errors=True)


def _print_streams(results: list[Result]) -> int:
    """The streams of each run, and a line to stderr for each run with any stream that went
    wrong (errored, ended early, or got other than its sequence's tokens): 1 if any did."""
    print()
    print_table(
        [
            "workers",
            "config",
            "streams",
            "finished",
            "open at end",
            "on another replica",
            "tokens streamed",
            "streamed/generated in window",
            "wrong",
        ],
        [
            [
                str(r.workers),
                r.name,
                str(len(r.streams)),
                str(sum(e.finished for e in r.streams)),
                str(sum(not (e.finished or e.problem) for e in r.streams)),
                f"{r.streams_elsewhere} of {r.streams_run}",
                str(sum(e.tokens for e in r.streams)),
                f"{r.streamed / r.tokens:.3f}" if r.tokens else "-",
                str(sum(bool(e.problem) for e in r.streams)),
            ]
            for r in results
        ],
    )
    wrong = False
    for r in results:
        bad = [e for e in r.streams if e.problem]
        if bad:
            wrong = True
            print(
                f"\nERROR: {len(bad)} of {len(r.streams)} streams of {r.workers} workers, "
                f"{r.name} went wrong; the first:",
                file=sys.stderr,
            )
            for e in bad[:5]:
                print(f"  seq {e.seq_id} on replica {e.replica}: {e.problem}", file=sys.stderr)
    return 1 if wrong else 0


def _print_commits(r: Result) -> None:
    """The saves each group commit held, and how its wait for them ended."""
    total = max(1.0, r.gathers and sum(r.gathers.values()) or 1.0)
    below, shares = 0.0, []
    for bound, cumulative in sorted(r.saves_per_commit.items()):
        if cumulative > below:
            shares.append(f"<={bound:g}: {(cumulative - below) / total:.0%}")
        below = cumulative
    gathers = ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(r.gathers.items()))
    saves = r.saves_committed / max(1.0, r.commits)
    decisions = max(1, r.decisions)
    print(
        f"\n{r.workers} workers, {r.name}: {saves:.1f} saves a commit; by count "
        f"({', '.join(shares)}); the wait ended: {gathers}; round trips a decision: "
        f"save {r.round_trips.get('save', 0) / decisions:.3f}, "
        f"claim {r.round_trips.get('claim', 0) / decisions:.3f}; the watchers' "
        f"round trips a second: {r.round_trips.get('watch', 0) / max(r.seconds, 1e-9):.1f}"
    )


def _print_statements(r: Result, limit: int) -> None:
    decisions = max(1, r.decisions)
    total = sum(ms for _, _, ms, _, _ in r.statements)
    print(
        f"\n{r.workers} workers, {r.name}: statements by execution time "
        f"({total / decisions:.3f} ms a decision in all; parse, commit and WAL flush not "
        "included)\n"
    )
    print_table(
        ["statement", "calls/dec", "rows/dec", "exec ms/dec", "WAL bytes/dec"],
        [
            [
                " ".join(query.split())[:90],
                f"{calls / decisions:.3f}",
                f"{rows / decisions:.2f}",
                f"{ms / decisions:.4f}",
                f"{int(wal) / decisions:.0f}",
            ]
            for calls, rows, ms, wal, query in r.statements[:limit]
        ],
    )
    print()
    print_table(
        ["PostgreSQL process", "CPU ms/dec"],
        [
            [kind, f"{cpu / decisions * 1000:.4f}"]
            for kind, cpu in sorted(r.database_cpu_by_kind.items(), key=lambda kv: -kv[1])
        ],
    )
    print()
    print_table(
        ["table", "inserted/dec", "updated/dec", "of them HOT/dec", "deleted/dec"],
        [
            [table, *(f"{n / decisions:.3f}" for n in rows)]
            for table, rows in sorted(r.table_rows.items())
            if any(rows)
        ],
    )


def run_config(name: str, directory: Path, cluster: PrivateCluster | None, args) -> Result:
    """One configuration at args.workers: start its processes, run, stop them."""
    label = f"{name}-w{args.workers}"
    procs = []
    url = None
    try:
        if name.startswith("sqlite"):
            state = [
                ["--state-dir", str(directory / f"{label}-{i}")] for i in range(_processes(name))
            ]
        else:
            url = _fresh_database(cluster, label.replace("-", "_"))
            state = [["--state", url, *args.serve_arg]] * _processes(name)
        started = [start_scheduler(s, directory, f"{label}-{i}") for i, s in enumerate(state)]
        procs = [p for p, _, _ in started]
        print(
            f"{args.workers} workers, {name}: running ({len(procs)} scheduler process(es))...",
            flush=True,
        )
        # The cluster only where it serves: a SQLite run must not count its idle CPU.
        served = cluster if url else None
        return run(name, [(t, m) for _, t, m in started], procs, served, args, url)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


def _fresh_database(cluster: PrivateCluster, name: str) -> str:
    import psycopg

    admin = cluster.url.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE template0")
    url = cluster.url.rsplit("/", 1)[0] + f"/{name}"
    if "pg_stat_statements" in " ".join(cluster.settings):
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    return url


def _progress(r: Result) -> str:
    decisions = max(1, r.decisions)
    streams = ""
    if r.streams:
        wrong = sum(bool(e.problem) for e in r.streams)
        streams = f", {len(r.streams)} streams ({wrong} wrong)"
    return (
        f"{r.decisions / r.seconds:.0f} decisions/s, scheduler "
        f"{r.scheduler_cpu / decisions * 1000:.2f} ms/decision, database "
        f"{r.database_cpu / decisions * 1000:.2f} ms/decision{streams}"
    )


def _row(r: Result) -> list[str]:
    decisions = max(1, r.decisions)
    round_trips = r.round_trips.get("save", 0) + r.round_trips.get("claim", 0)
    sqlite = r.name.startswith("sqlite")
    return [
        str(r.workers),
        r.name,
        f"{r.decisions / r.seconds:.0f}",
        f"{percentile(r.latencies, 50) * 1000:.2f}",
        f"{percentile(r.latencies, 99) * 1000:.2f}",
        f"{r.scheduler_cpu / decisions * 1000:.2f}",
        "-" if sqlite else f"{r.database_cpu / decisions * 1000:.3f}",
        "-" if sqlite else f"{round_trips / decisions:.2f}",
        "-" if sqlite else f"{r.commits / decisions:.2f}",
        "-" if sqlite else f"{r.round_trips.get('submit', 0) / max(1, r.submits):.2f}",
        f"{percentile(r.submit_latencies, 50) * 1000:.2f}",
        f"{r.tokens / decisions:.1f}",
    ]


# --------------------------------------------------------------------------- --streams


class StreamClient:
    """--streams: every sequence submitted by a Generate stream, the streams round-robin
    over the configuration's schedulers and read to their end in a process of its own
    (grpc.aio), so that reading them neither counts as the schedulers' or PostgreSQL's CPU
    nor takes the GIL from the fake workers' threads here."""

    def __init__(self, name: str, targets: list[str], count: int, new_tokens: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._done, self._results = context.Event(), context.Queue()
        self._streamed = context.Value("q", 0, lock=False)  # tokens read, all streams
        self._process = context.Process(
            target=_stream_client,
            args=(targets, name, count, new_tokens, self._done, self._results, self._streamed),
            daemon=True,
        )
        self._process.start()

    def opened(self) -> list[float]:
        """Once every stream has its sequence: the seconds each took to get it (its
        submit), sorted."""
        return sorted(self._answer("opened", _OPEN_SECONDS))

    def streamed(self) -> int:
        """Tokens read so far, all streams together."""
        return self._streamed.value

    def close(self) -> list[StreamEnd]:
        """Once the fake workers have stopped: let each open stream catch up with its
        sequence's count, close it, and say how every stream ended."""
        self._done.set()
        ends = self._answer("ended", _CATCH_UP_SECONDS + 60)
        self._process.join(10)
        return ends

    def _answer(self, kind: str, timeout_seconds: float):
        deadline = time.monotonic() + timeout_seconds
        while True:
            try:
                got, value = self._results.get(timeout=1.0)
            except queue.Empty:
                if not self._process.is_alive():
                    raise RuntimeError(
                        f"the stream client exited (status {self._process.exitcode}) "
                        f"before it said {kind!r}"
                    ) from None
                if time.monotonic() < deadline:
                    continue
                self._process.kill()
                raise RuntimeError(
                    f"the stream client said nothing of {kind!r} in {timeout_seconds:g} s"
                ) from None
            if got == "failed":
                raise RuntimeError(f"the stream client failed:\n{value}")
            assert got == kind, (got, kind)
            return value


# How long the streams may take to open (submit), and once the workers have stopped, to
# catch up with their sequences' counts.
_OPEN_SECONDS = 600.0
_CATCH_UP_SECONDS = 15.0


def _stream_client(targets, name, count, new_tokens, done, results, streamed) -> None:
    """The stream client process (StreamClient): puts ("opened", submit seconds), then
    once `done` is set ("ended", [StreamEnd]), or ("failed", the traceback)."""
    try:
        asyncio.run(_read_streams(targets, name, count, new_tokens, done, results, streamed))
    except BaseException:
        results.put(("failed", traceback.format_exc()))
        raise


class _Stream:
    """One stream as it is read."""

    def __init__(self, replica: int) -> None:
        self.end = StreamEnd(0, replica)
        self.other_tokens = 0  # tokens other than the fake workers' one token
        self.reason = pb.FINISH_REASON_UNSPECIFIED
        self.closing = False


async def _read_streams(targets, name, count, new_tokens, done, results, streamed) -> None:
    channels = [grpc.aio.insecure_channel(t) for t in targets]
    stubs = [pb_grpc.SchedulerStub(c) for c in channels]
    streams = [_Stream(i % len(stubs)) for i in range(count)]
    submitting = asyncio.Semaphore(8)  # as many submits in flight as the Submits' threads
    latencies: list[float] = []
    unopened = count
    all_opened = asyncio.Event()
    if not count:
        all_opened.set()

    def opened() -> None:
        nonlocal unopened
        unopened -= 1
        if not unopened:
            all_opened.set()

    async def read(i: int, stream: _Stream) -> None:
        end, call = stream.end, None
        try:
            async with submitting:
                t0 = time.perf_counter()
                call = stubs[end.replica].Generate(
                    pb.SubmitRequest(
                        prompt_token_ids=_PROMPT,
                        max_new_tokens=new_tokens,
                        request_id=f"{name}-{i}",
                    )
                )
                first = await call.read()
                latencies.append(time.perf_counter() - t0)
            if first is grpc.aio.EOF:
                end.problem = "ended before its first event"
                return
            end.seq_id = first.seq_id
            opened()
            while (event := await call.read()) is not grpc.aio.EOF:
                end.tokens += len(event.token_ids)
                stream.other_tokens += sum(t != _TOKEN for t in event.token_ids)
                streamed.value += len(event.token_ids)
                if event.finished:
                    end.finished, stream.reason = True, event.finish_reason
            if not end.finished:
                end.problem = f"ended without its last event, after {end.tokens} tokens"
        except asyncio.CancelledError:
            if call is not None:
                call.cancel()
        except grpc.aio.AioRpcError as err:
            if not stream.closing:
                end.problem = f"{err.code().name}: {err.details()}"
        finally:
            if not end.seq_id:
                opened()

    tasks = [asyncio.ensure_future(read(i, s)) for i, s in enumerate(streams)]
    await all_opened.wait()
    results.put(("opened", latencies))
    await asyncio.to_thread(done.wait)
    # The fake workers have stopped, each after its last answer, which waited for the
    # commit of its report: what GetSequence says now is each sequence's last count.
    still_open = [s for s in streams if s.end.seq_id and not s.end.finished and not s.end.problem]
    expected: dict[int, int] = {}
    asking = asyncio.Semaphore(32)

    async def ask(stream: _Stream) -> None:
        async with asking:
            try:
                info = await stubs[stream.end.replica].GetSequence(
                    pb.GetSequenceRequest(seq_id=stream.end.seq_id), timeout=30
                )
            except grpc.aio.AioRpcError as err:
                stream.end.problem = f"GetSequence: {err.code().name}: {err.details()}"
                return
            expected[stream.end.seq_id] = info.generated_tokens

    await asyncio.gather(*(ask(s) for s in still_open))
    deadline = time.monotonic() + _CATCH_UP_SECONDS
    while time.monotonic() < deadline and any(
        not s.end.finished and s.end.tokens < expected.get(s.end.seq_id, 0) for s in still_open
    ):
        await asyncio.sleep(0.05)
    for stream in streams:
        stream.closing = True
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for channel in channels:
        await channel.close()
    for stream in streams:
        end = stream.end
        if end.problem:
            continue
        if end.finished:
            if stream.reason != pb.FINISH_REASON_MAX_LENGTH:
                end.problem = f"finished as {pb.FinishReason.Name(stream.reason)}"
            elif end.tokens != new_tokens:
                end.problem = f"got {end.tokens} tokens of the {new_tokens} its sequence generated"
        elif end.seq_id in expected and end.tokens != expected[end.seq_id]:
            end.problem = (
                f"open at the end with {end.tokens} tokens of the {expected[end.seq_id]} "
                "its sequence had generated"
            )
        if stream.other_tokens and not end.problem:
            end.problem = f"{stream.other_tokens} tokens other than the workers' {_TOKEN}"
    results.put(("ended", [s.end for s in streams]))


# --------------------------------------------------------------------------- follow-ups


def followups_main(argv: list[str]) -> int:
    """Follow-up turns that resume from their prefix: one scheduler with 4 scripted workers
    beside 2 replicas with 2 each (claims following homes, and with homes off)."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.replicas followups", description=followups_main.__doc__
    )
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--cache-block-tokens", type=int, default=64)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument(
        "--configs", default="single,replicas,replicas-no-homes", help="comma-separated"
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the scratch folder (logs) after a run"
    )
    args = parser.parse_args(argv)
    directory = Path(tempfile.mkdtemp(prefix="lattice-bench-followups-"))
    os.chmod(directory, 0o755)
    rows = []
    cluster = None
    with _scratch(directory, args.keep):
        try:
            for config in args.configs.split(","):
                if config != "single" and cluster is None:
                    cluster = PrivateCluster(directory / "pg").start()
                resumed, follow_ups, cached, prompt = _followups_run(
                    config, directory, cluster, args
                )
                print(f"  {config}: {resumed} of {follow_ups} follow-ups resumed", flush=True)
                rows.append(
                    [
                        config,
                        f"{resumed} / {follow_ups}",
                        f"{resumed / max(1, follow_ups):.2f}",
                        f"{cached} / {prompt}",
                    ]
                )
        finally:
            if cluster is not None:
                cluster.stop("immediate")  # its folder (and postgres.log) goes with the scratch
    print(
        f"\n{args.conversations} conversations x {args.turns} turns, scripted workers "
        f"(--step-ms {args.step_ms:g}, --cache-block-tokens {args.cache_block_tokens}); "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n"
    )
    print_table(["config", "follow-ups resumed", "fraction", "cached / prompt tokens"], rows)
    return 0


def _followups_run(config: str, directory: Path, cluster, args) -> tuple[int, int, int, int]:
    """Run the conversations on `config`; (resumed, follow-ups, cached tokens, prompt
    tokens of the follow-ups)."""
    procs = []
    try:
        if config == "single":
            schedulers = [spawn_scheduler(config, directory, "--policy", "fifo", port=free_port())]
            homes = [0, 0, 0, 0]
        else:
            url = _fresh_database(cluster, config.replace("-", "_"))
            extra = ["--replica-affinity-ms", "0"] if config == "replicas-no-homes" else []
            schedulers = [
                spawn_scheduler(
                    f"{config}-{i}",
                    directory,
                    "--policy",
                    "fifo",
                    "--state",
                    url,
                    *extra,
                    port=free_port(),
                )
                for i in range(2)
            ]
            homes = [0, 0, 1, 1]
        procs.extend(s.popen for s in schedulers)
        targets = [f"127.0.0.1:{s.ports[0]}" for s in schedulers]
        for i, home in enumerate(homes):
            order = targets[home:] + targets[:home]
            log = open(directory / f"{config}-w{i}.log", "w")
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "worker_client",
                        "--scheduler",
                        ",".join(order),
                        "--worker-id",
                        f"w{i}",
                        "--model",
                        "scripted",
                        "--step-ms",
                        str(args.step_ms),
                        "--cache-block-tokens",
                        str(args.cache_block_tokens),
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                )
            )
        channels = [grpc.insecure_channel(t) for t in targets]
        stubs = [pb_grpc.SchedulerStub(c) for c in channels]
        deadline = time.monotonic() + 60
        while sum(len(s.GetStatus(pb.GetStatusRequest(), timeout=10).workers) for s in stubs) < 4:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{config}: the workers did not register")
            time.sleep(0.2)

        def converse(index: int) -> list[tuple[int, int, int]]:
            """(turn, prompt_len, cached_tokens) of each turn of one conversation."""
            rng = random.Random(index)
            prompt: list[int] = []
            turns = []
            for turn in range(args.turns):
                prompt += [rng.randrange(2, 30000) for _ in range(rng.randrange(60, 120))]
                stub = stubs[(index + turn) % len(stubs)]  # a client's calls spread alike
                seq_id, output = 0, []
                for event in stub.Generate(
                    pb.SubmitRequest(prompt_token_ids=prompt, max_new_tokens=16), timeout=120
                ):
                    seq_id = seq_id or event.seq_id
                    output.extend(event.token_ids)
                cached = max(
                    s.GetSequence(pb.GetSequenceRequest(seq_id=seq_id), timeout=10).cached_tokens
                    for s in stubs
                )
                turns.append((turn, len(prompt), cached))
                prompt += output
            return turns

        with ThreadPoolExecutor(args.conversations) as pool:
            runs = list(pool.map(converse, range(args.conversations)))
        for channel in channels:
            channel.close()
        resumed = follow_ups = cached_total = prompt_total = 0
        block = args.cache_block_tokens
        for turns in runs:
            for (_, previous_len, _), (_, prompt_len, cached) in zip(turns, turns[1:]):
                follow_ups += 1
                resumed += cached >= previous_len - block
                cached_total += cached
                prompt_total += prompt_len
        return resumed, follow_ups, cached_total, prompt_total
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    if sys.argv[1:2] == ["followups"]:
        sys.exit(followups_main(sys.argv[2:]))
    sys.exit(main())
