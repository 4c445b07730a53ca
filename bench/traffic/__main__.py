#!/usr/bin/env python3
"""The scheduler under a fleet's traffic: each subcommand prints its comparison side by side.

Every scheduler here is a real `lattice-scheduler serve` process on loopback (its RSS and
CPU time read from /proc); clients and fake workers run in this process on one asyncio
loop (grpc.aio), scripted workers are `lattice-worker --model scripted` processes.
`--before DIR` adds rows from the scheduler of another checkout (e.g. a worktree of the
commit before this change), started with this interpreter from DIR.

    .venv/bin/python -m bench.traffic streams     # 10,000 idle Generate streams, 16 workers
    .venv/bin/python -m bench.traffic honest      # 2,000 streams read to the end, 4 workers
    .venv/bin/python -m bench.traffic watch       # 1,000 unauthenticated Health.Watch, tokens on
    .venv/bin/python -m bench.traffic decisions   # decisions/s, 64 workers: echo, unary, session
    .venv/bin/python -m bench.traffic overlap     # 8 scripted workers, --step-ms 10
    .venv/bin/python -m bench.traffic idle        # 16 idle workers: CPU, Submit to a worker
    .venv/bin/python -m bench.traffic submits     # acknowledged Submits/s, 16 submitters
    .venv/bin/python -m bench.traffic report-cost # CPU per report, 256 decoding
    .venv/bin/python -m bench.traffic report-cost --floor  # and what no scheduling costs

The machine these ran on has 2 cores shared with other work: read ratios within one run.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import secrets
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from prometheus_client.parser import text_string_to_metric_families

from common.processes import LOOPBACK, SCHEDULER_LISTENING, Process, clean_env, scheduler_argv
from common.waiting import wait_until
from worker_client.convert import PendingReport

ROOT = Path(__file__).resolve().parents[2]
ECHO_LISTENING = re.compile(r"echo listening on (\d+)")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PROMPT = list(range(1, 17))
RPC_TIMEOUT = 30.0


# ====================================================================== processes


class Proc(Process):
    """A started process, its output in a temporary file, and /proc readings of it."""

    def __init__(self, argv: list[str], cwd: Path = ROOT, env: dict | None = None) -> None:
        log = tempfile.NamedTemporaryFile(prefix="bench_traffic_", suffix=".log", delete=False)
        log.close()
        super().__init__(" ".join(argv[1:4]), argv, Path(log.name), cwd=cwd,
                         env=env or _env())

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.popen.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.popen.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime

    def stop(self) -> None:
        super().stop(10)
        self.log_path.unlink(missing_ok=True)


def _env(root: Path = ROOT) -> dict[str, str]:
    env = clean_env()
    if root != ROOT:
        env["PYTHONPATH"] = f"{root}{os.pathsep}{root / 'protos'}"
    return env


@dataclass
class Scheduler:
    proc: Proc
    port: int
    metrics_port: int

    @property
    def target(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def metric(self, name: str) -> float:
        return sum(self.samples(name).values())

    def samples(self, name: str) -> dict[tuple, float]:
        url = f"http://{LOOPBACK}:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        return {tuple(sorted(s.labels.items())): s.value
                for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == name}

    def histogram(self) -> dict[float, float]:
        """SelectBatch's histogram now: cumulative count per upper bound (seconds)."""
        return {float(dict(labels)["le"]): value for labels, value in
                self.samples("lattice_scheduler_select_batch_duration_seconds_bucket").items()}


def histogram_p99(before: dict[float, float], after: dict[float, float]) -> str:
    """The upper bound of the bucket holding the 99th percentile of what came in between."""
    total = after[float("inf")] - before.get(float("inf"), 0.0)
    for bound in sorted(after):
        if after[bound] - before.get(bound, 0.0) >= 0.99 * total:
            return "> 1000" if bound == float("inf") else f"<= {bound * 1000:g}"
    return "-"


def start_scheduler(*flags: str, root: Path = ROOT) -> Scheduler:
    """A scheduler process; leases of 10 minutes, as the fake workers pause between phases."""
    proc = Proc(scheduler_argv("--log-level", "WARNING", "--lease-ttl-ms", "600000", *flags),
                cwd=root, env=_env(root))
    proc.wait_listening(SCHEDULER_LISTENING)
    return Scheduler(proc, *proc.ports)


def start_scripted_workers(scheduler: Scheduler, count: int, *flags: str,
                           root: Path = ROOT) -> list[Proc]:
    return [Proc([sys.executable, "-m", "worker_client", "--scheduler", scheduler.target,
                  "--worker-id", f"scripted-{i}", "--model", "scripted", "--log-format",
                  "json", *flags], cwd=root, env=_env(root)) for i in range(count)]


def stop_all(*procs) -> None:
    for p in procs:
        p.stop()


# ====================================================================== fake workers


class FakeWorker:
    """A worker speaking the wire protocol from this process: unary calls or one session.

    `worker_form`: its reports are built as the project's worker builds them
    (worker_client.convert.PendingReport: packed tokens with offsets, and a running list
    left out when unchanged, each only where the scheduler's registration allows it);
    otherwise one TokenUpdate per sequence without offsets, the running list in full."""

    def __init__(self, channel: grpc.aio.Channel, worker_id: str, session: bool,
                 metadata=(), worker_form: bool = False) -> None:
        self.stub = pb_grpc.SchedulerStub(channel)
        self.worker_id = worker_id
        self.session = session
        self._metadata = metadata
        self._call = None
        self.running: list[int] = []
        self._pending = PendingReport() if worker_form else None

    async def register(self, max_batch_size: int, slots: int) -> None:
        settings = await self.stub.RegisterWorker(pb.RegisterWorkerRequest(
            worker_id=self.worker_id, total_kv_pages=1_000_000, page_size=16,
            total_gdn_slots=slots, max_batch_size=max_batch_size),
            timeout=RPC_TIMEOUT, metadata=self._metadata)
        if self._pending is not None:
            self._pending.packed_tokens = settings.accepts_token_runs
            self._pending.running_unchanged = settings.accepts_running_unchanged

    async def select(self, request: pb.SelectBatchRequest) -> pb.SchedulerDecision:
        if not self.session:
            decision = await self.stub.SelectBatch(request, timeout=RPC_TIMEOUT + 5,
                                                   metadata=self._metadata)
        else:
            if self._call is None:
                self._call = self.stub.WorkerSession(metadata=self._metadata)
            await self._call.write(request)
            decision = await self._call.read()
        if self._pending is not None:
            self._pending.delivered(decision.iteration)
        return decision

    def report(self, slots: int, tokens: bool = True, idle_wait_ms: int = 0,
               ) -> pb.SelectBatchRequest:
        """What it holds (running, one new token each when `tokens`), and free slots."""
        if self._pending is not None:
            if tokens:
                self._pending.tokens.update((s, [7]) for s in self.running)
            return self._pending.request(
                self.worker_id, waiting=(), running=self.running, kv_free_pages=1_000_000,
                gdn_free_slots=max(0, slots - len(self.running)), draining=False,
                idle_wait_seconds=idle_wait_ms / 1000)
        return pb.SelectBatchRequest(
            worker_id=self.worker_id, running=self.running, kv_free_pages=1_000_000,
            gdn_free_slots=max(0, slots - len(self.running)), idle_wait_ms=idle_wait_ms,
            tokens=[pb.TokenUpdate(seq_id=s, token_ids=[7]) for s in self.running]
            if tokens else [])

    async def admit(self, slots: int) -> None:
        """One call that fills its batch from the queue."""
        decision = await self.select(self.report(slots, tokens=False))
        admitted = [c.seq_id for c in decision.prefill if c.HasField("spec")]
        if self._pending is not None:
            for seq_id in admitted:
                self._pending.admitted(seq_id)
        self.running += admitted

    async def close(self) -> None:
        if self._call is not None:
            await self._call.done_writing()
            self._call.cancel()


async def iterate_for(workers: list[FakeWorker], seconds: float, slots: int,
                      tokens: bool = True, step_seconds: float = 0.0) -> list[float]:
    """Every worker reports and reads its decision, then spends `step_seconds` on its step
    (0: back to back, the scheduler saturated); each round trip's seconds."""
    latencies: list[float] = []
    end = time.perf_counter() + seconds

    async def one(worker: FakeWorker) -> None:
        while time.perf_counter() < end:
            started = time.perf_counter()
            await worker.select(worker.report(slots, tokens))
            latencies.append(time.perf_counter() - started)
            if step_seconds:
                await asyncio.sleep(step_seconds)

    await asyncio.gather(*(one(w) for w in workers))
    return latencies


def channels(target: str, count: int) -> list[grpc.aio.Channel]:
    return [grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(count)]


# ====================================================================== figures


def pct(values: list[float], percent: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(percent / 100 * len(ordered) + 0.5) - 1))
    return ordered[index]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


def table(header: list[str], rows: list[list[object]]) -> None:
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    for row in [header, *rows]:
        print("  ".join(str(x).rjust(w) if i else str(x).ljust(w)
                        for i, (x, w) in enumerate(zip(row, widths))))


def load_note() -> str:
    one, five, _ = os.getloadavg()
    return f"({os.cpu_count()} cores, load average {one:.1f} / {five:.1f} over 1 / 5 min)"


async def submit_many(stub, count: int, max_new_tokens: int = 3000) -> list[int]:
    request = pb.SubmitRequest(prompt_token_ids=PROMPT, max_new_tokens=max_new_tokens)
    ids = []
    for start in range(0, count, 200):
        answers = await asyncio.gather(*(stub.Submit(request, timeout=RPC_TIMEOUT)
                                         for _ in range(min(200, count - start))))
        ids += [a.seq_id for a in answers]
    return ids


# ====================================================================== streams


async def _streams(scheduler: Scheduler, args) -> list[list[object]]:
    """Idle Generate streams next to iterating workers: SelectBatch before and after."""
    [ch] = channels(scheduler.target, 1)
    stub = pb_grpc.SchedulerStub(ch)
    await submit_many(stub, args.workers * args.batch)
    workers = [FakeWorker(ch, f"w{i}", session=True) for i in range(args.workers)]
    for w in workers:
        await w.register(args.batch, args.batch)
        await w.admit(args.batch)
    step = args.step_ms / 1000
    await iterate_for(workers, 1.0, args.batch, step_seconds=step)  # warm-up
    histogram_0 = scheduler.histogram()
    before = await iterate_for(workers, args.seconds, args.batch, step_seconds=step)
    histogram_1 = scheduler.histogram()
    rss_before = scheduler.proc.rss_bytes()

    stream_channels = channels(scheduler.target, max(1, args.streams // 500))
    request = pb.SubmitRequest(prompt_token_ids=PROMPT, max_new_tokens=16)
    calls = [pb_grpc.SchedulerStub(stream_channels[i % len(stream_channels)]).Generate(
        request, timeout=3600) for i in range(args.streams)]
    opened = time.perf_counter()
    firsts = await asyncio.gather(*(c.read() for c in calls), return_exceptions=True)
    open_seconds = time.perf_counter() - opened
    num_open = sum(isinstance(f, pb.GenerateEvent) for f in firsts)
    await asyncio.sleep(1.0)
    rss_after = scheduler.proc.rss_bytes()
    histogram_2 = scheduler.histogram()
    during = await iterate_for(workers, args.seconds, args.batch, step_seconds=step)
    histogram_3 = scheduler.histogram()
    for c in calls:
        c.cancel()
    for w in workers:
        await w.close()
    for c in [ch, *stream_channels]:
        await c.close()
    per_stream = (rss_after - rss_before) / max(1, num_open)
    return [
        ["no streams", 0, len(before), ms(statistics.median(before)), ms(pct(before, 99)),
         histogram_p99(histogram_0, histogram_1), f"{rss_before / 2**20:.0f}", "-"],
        [f"{num_open} idle streams", num_open, len(during), ms(statistics.median(during)),
         ms(pct(during, 99)), histogram_p99(histogram_2, histogram_3),
         f"{rss_after / 2**20:.0f}", f"{per_stream / 1024:.1f} (opened in {open_seconds:.1f} s)"],
    ]


def cmd_streams(args) -> None:
    pace = (f"each step taking {args.step_ms:g} ms (as a GPU would)" if args.step_ms
            else "back to back (the scheduler saturated)")
    print(f"{args.streams} idle Generate streams on one scheduler, {args.workers} workers "
          f"(sessions) iterating {pace}, each with {args.batch} running sequences and "
          f"one new token each per iteration; {args.seconds:g} s per row {load_note()}")
    scheduler = start_scheduler("--max-streams", str(args.streams + 100),
                                "--max-batch-size", str(args.batch))
    try:
        rows = asyncio.run(_streams(scheduler, args))
    finally:
        scheduler.proc.stop()
    table(["", "streams", "SelectBatch calls", "p50 ms", "p99 ms", "server p99 ms",
           "server RSS MiB", "RSS per stream KiB"], rows)
    print("p50, p99: round trips timed by the workers; server p99: the bucket of the "
          "scheduler's own histogram (from arrival, loop lag included)")


# ====================================================================== honest streams


async def _honest(target: str, num_streams: int, max_new_tokens: int,
                  timeout: float) -> tuple[int, int, float, list[float], list[str]]:
    chans = channels(target, max(1, num_streams // 500))
    request = pb.SubmitRequest(prompt_token_ids=PROMPT, max_new_tokens=max_new_tokens)
    e2e: list[float] = []
    errors: list[str] = []
    tokens = 0

    async def one(i: int) -> None:
        nonlocal tokens
        started = time.perf_counter()
        try:
            call = pb_grpc.SchedulerStub(chans[i % len(chans)]).Generate(request,
                                                                        timeout=timeout)
            async for event in call:
                tokens += len(event.token_ids)
                if event.finished:
                    e2e.append(time.perf_counter() - started)
        except grpc.RpcError as err:
            errors.append(err.code().name)

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(num_streams)))
    wall = time.perf_counter() - started
    for c in chans:
        await c.close()
    return len(e2e), tokens, wall, e2e, errors


def cmd_honest(args) -> None:
    print(f"{args.streams} Generate streams at once, read to the end ({args.max_new_tokens} "
          f"tokens each), {args.workers} scripted worker processes (batch {args.batch}); "
          f"timeout {args.timeout:g} s {load_note()}")
    rows = []
    for label, root, flags in _versions(args):
        if root == ROOT:
            flags = ("--max-streams", str(args.streams + 100), *flags)
        scheduler = start_scheduler(*flags, root=root)
        workers = start_scripted_workers(scheduler, args.workers, "--max-batch-size",
                                         str(args.batch), "--gdn-slots", str(args.batch),
                                         "--kv-pages", "100000")
        try:
            time.sleep(2.0)
            done, tokens, wall, e2e, errors = asyncio.run(
                _honest(scheduler.target, args.streams, args.max_new_tokens, args.timeout))
        finally:
            stop_all(*workers, scheduler.proc)
        rows.append([label, f"{done}/{args.streams}", tokens, f"{wall:.1f}",
                     f"{tokens / wall:.0f}", f"{pct(e2e, 99):.2f}" if e2e else "-",
                     ", ".join(f"{e} x{errors.count(e)}" for e in sorted(set(errors))) or "-"])
    table(["", "finished", "tokens", "wall s", "tokens/s", "e2e p99 s", "errors"], rows)


def _versions(args) -> list[tuple[str, Path, tuple[str, ...]]]:
    versions = [("this scheduler", ROOT, ())]
    if args.before:
        versions.insert(0, ("before", Path(args.before).resolve(), ()))
    return versions


# ====================================================================== watch


async def _watch(scheduler: Scheduler, args, worker_tokens: dict[str, str]) -> list[list]:
    [ch] = channels(scheduler.target, 1)
    workers = [FakeWorker(ch, w, session=True, metadata=(("authorization", f"Bearer {t}"),))
               for w, t in worker_tokens.items() if w != "admin"]
    client = pb_grpc.SchedulerStub(ch)
    admin = (("authorization", f"Bearer {worker_tokens['admin']}"),)
    for w in workers:
        await w.register(args.batch, args.batch)
    await submit_many_with(client, len(workers) * args.batch, admin)
    for w in workers:
        await w.admit(args.batch)
    await iterate_for(workers, 1.0, args.batch)
    quiet = await iterate_for(workers, args.seconds, args.batch)
    watch_channels = channels(scheduler.target, max(1, args.watchers // 250))
    watches = [health_pb2_grpc.HealthStub(watch_channels[i % len(watch_channels)]).Watch(
        health_pb2.HealthCheckRequest(service=""), timeout=3600) for i in range(args.watchers)]
    firsts = await asyncio.gather(*(w.read() for w in watches), return_exceptions=True)
    accepted = sum(isinstance(f, health_pb2.HealthCheckResponse) for f in firsts)
    refused = sum(isinstance(f, grpc.RpcError)
                  and f.code() is grpc.StatusCode.RESOURCE_EXHAUSTED for f in firsts)
    loaded = await iterate_for(workers, args.seconds, args.batch)
    for w in watches:
        w.cancel()
    for w in workers:
        await w.close()
    for c in [ch, *watch_channels]:
        await c.close()
    return [["no watchers", "-", len(quiet), ms(statistics.median(quiet)), ms(pct(quiet, 99)),
             "1.00"],
            [f"{args.watchers} Health.Watch, no token", f"{accepted} open, {refused} refused",
             len(loaded), ms(statistics.median(loaded)), ms(pct(loaded, 99)),
             f"{pct(loaded, 99) / pct(quiet, 99):.2f}"]]


async def submit_many_with(stub, count: int, metadata) -> None:
    request = pb.SubmitRequest(prompt_token_ids=PROMPT, max_new_tokens=3000)
    for start in range(0, count, 200):
        await asyncio.gather(*(stub.Submit(request, timeout=RPC_TIMEOUT, metadata=metadata)
                               for _ in range(min(200, count - start))))


def cmd_watch(args) -> None:
    print(f"{args.watchers} Health.Watch streams without a token against a scheduler with "
          f"--auth-tokens, next to {args.workers} workers (tokens, sessions) iterating with "
          f"{args.batch} running each; {args.seconds:g} s per row {load_note()}")
    names = [f"w{i}" for i in range(args.workers)]
    tokens = {name: secrets.token_urlsafe(24) for name in [*names, "admin"]}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokens.toml"
        path.write_text("".join(
            f'[[tokens]]\ntoken = "{t}"\nrole = "worker"\nworker_id = "{n}"\n\n'
            for n, t in tokens.items() if n != "admin")
            + f'[[tokens]]\ntoken = "{tokens["admin"]}"\nrole = "admin"\n')
        scheduler = start_scheduler("--auth-tokens", str(path), "--max-batch-size",
                                    str(args.batch))
        try:
            rows = asyncio.run(_watch(scheduler, args, tokens))
        finally:
            scheduler.proc.stop()
    table(["", "watch streams", "SelectBatch calls", "p50 ms", "p99 ms", "p99 vs none"], rows)


# ====================================================================== decisions


class EchoServicer(pb_grpc.SchedulerServicer):
    """The floor: answers each report with a decision naming its running ids, nothing else.

    `new_form`: its registration says it takes packed tokens and unchanged running lists
    (as the scheduler's does), and a report that leaves its list out gets
    `decode_all_running`, so that the reports and answers are the project's worker's."""

    def __init__(self, new_form: bool = False) -> None:
        self._new_form = new_form

    @staticmethod
    def _answer(request: pb.SelectBatchRequest) -> pb.SchedulerDecision:
        if request.running_unchanged_since and not request.running:
            return pb.SchedulerDecision(decode_all_running=True, iteration=1)
        return pb.SchedulerDecision(decode=request.running, iteration=1)

    async def SelectBatch(self, request, context):
        return self._answer(request)

    async def WorkerSession(self, request_iterator, context):
        async for request in request_iterator:
            yield self._answer(request)

    async def RegisterWorker(self, request, context):
        return pb.RegisterWorkerResponse(max_batch_size=request.max_batch_size,
                                         accepts_token_runs=self._new_form,
                                         accepts_running_unchanged=self._new_form)


def _echo_interceptors(which: str, tokens_path: str | None) -> list:
    """The interceptors the scheduler's main port has (service/server/app.py): `default`
    (decode errors, stream limits) or `auth` (the bearer-token check between them)."""
    if which == "none":
        return []
    from service.server.interceptors import auth, decode_errors, limits
    first = [decode_errors.DecodeErrorInterceptor()]
    if which == "auth":
        first.append(auth.AuthInterceptor(auth.load_tokens(tokens_path)))
    return [*first, limits.StreamLimitInterceptor(max_streams=10_000, max_open_streams=1000)]


async def _echo_server(port: int, new_form: bool, interceptors: list) -> None:
    server = grpc.aio.server(interceptors=interceptors)
    pb_grpc.add_SchedulerServicer_to_server(EchoServicer(new_form), server)
    bound = server.add_insecure_port(f"{LOOPBACK}:{port}")
    await server.start()
    print(f"echo listening on {bound}", flush=True)
    await server.wait_for_termination()


def cmd_echo_server(args) -> None:
    asyncio.run(_echo_server(args.port, args.new_form,
                             _echo_interceptors(args.interceptors, args.tokens)))


async def _decisions(target: str, args, session: bool, echo: bool) -> tuple[int, float]:
    chans = channels(target, 4)
    workers = [FakeWorker(chans[i % len(chans)], f"d{i}", session, worker_form=True)
               for i in range(args.workers)]
    for w in workers:
        await w.register(args.batch, args.batch)
    if echo:
        for i, w in enumerate(workers):
            w.running = list(range(i * args.batch + 1, (i + 1) * args.batch + 1))
    else:
        await submit_many(pb_grpc.SchedulerStub(chans[0]), args.workers * args.batch)
        for w in workers:
            await w.admit(args.batch)
    await iterate_for(workers, 1.0, args.batch)
    started = time.process_time()
    latencies = await iterate_for(workers, args.seconds, args.batch)
    client_cpu = time.process_time() - started
    for w in workers:
        await w.close()
    for c in chans:
        await c.close()
    return len(latencies), client_cpu


def cmd_decisions(args) -> None:
    print(f"decisions/s: {args.workers} workers in this process, each reporting "
          f"{args.batch} running sequences with a token each and waiting for its decision, "
          f"back to back, {args.seconds:g} s per run, each report in the form the project's "
          f"worker sends to that scheduler; {args.rounds} rounds, each running "
          f"every row once in turn, so that the machine's load falls on all rows alike "
          f"{load_note()}")
    runs = [("bare echo servicer, unary", "echo", False),
            ("bare echo servicer, session", "echo", True)]
    runs += [(f"{label}, {way}", root, session) for label, root, _ in _versions(args)
             for way, session in (("unary", False), ("session", True))]
    rates: dict[str, list[float]] = {label: [] for label, _, _ in runs}
    cores: dict[str, list[float]] = {label: [] for label, _, _ in runs}
    for _ in range(args.rounds):
        for label, root, session in runs:
            rate, server_cores = _decisions_run(args, root, session)
            rates[label].append(rate)
            cores[label].append(server_cores)
    rows = [[label, " ".join(f"{r:.0f}" for r in rates[label]),
             f"{statistics.median(rates[label]):.0f}", f"{max(rates[label]):.0f}",
             f"{statistics.median(cores[label]):.2f}"] for label, _, _ in runs]
    table(["", "decisions/s per round", "median", "best", "server cores (median)"], rows)


def _decisions_run(args, root, session: bool) -> tuple[float, float]:
    if root == "echo":
        proc = Proc([sys.executable, "-m", "bench.traffic", "echo-server"])
        target = f"{LOOPBACK}:{proc.wait_listening(ECHO_LISTENING).group(1)}"
    else:
        # The same policy (budget) for every version, so that the rows compare the path.
        scheduler = start_scheduler("--max-batch-size", str(args.batch), "--policy", "budget",
                                    root=root)
        proc, target = scheduler.proc, scheduler.target
    try:
        cpu_before, wall_before = proc.cpu_seconds(), time.perf_counter()
        count, _ = asyncio.run(_decisions(target, args, session, root == "echo"))
        server_cores = (proc.cpu_seconds() - cpu_before) / (time.perf_counter() - wall_before)
    finally:
        proc.stop()
    return count / args.seconds, server_cores


# ====================================================================== overlap


def _overlap_run(args, overlap: bool) -> tuple[float, float, int]:
    scheduler = start_scheduler("--max-batch-size", str(args.batch))
    flags = ["--step-ms", str(args.step_ms), "--max-batch-size", str(args.batch),
             "--gdn-slots", str(args.batch), "--kv-pages", "100000"]
    workers = start_scripted_workers(scheduler, args.workers,
                                     *flags, *([] if overlap else ["--no-overlap"]))
    try:
        channel = grpc.insecure_channel(scheduler.target)
        stub = pb_grpc.SchedulerStub(channel)
        wait_until(lambda: len(stub.GetStatus(pb.GetStatusRequest(), timeout=10).workers)
                   >= args.workers, "the scripted workers to register", 60, every_seconds=0.2)
        request = pb.SubmitRequest(prompt_token_ids=PROMPT, max_new_tokens=args.max_new_tokens)
        total = args.workers * args.batch
        for _ in range(total):
            stub.Submit(request, timeout=RPC_TIMEOUT)
        # Steady state: every worker full and decoding; measure the middle of the run.
        time.sleep(args.max_new_tokens * args.step_ms / 1000 * 0.2)
        tokens_0, at_0 = scheduler.metric("lattice_scheduler_generation_tokens_total"), \
            time.perf_counter()
        time.sleep(args.max_new_tokens * args.step_ms / 1000 * 0.5)
        tokens_1, at_1 = scheduler.metric("lattice_scheduler_generation_tokens_total"), \
            time.perf_counter()
        while stub.GetStatus(pb.GetStatusRequest(), timeout=10).queue_depth or \
                scheduler.metric("lattice_scheduler_finished_total") < total:
            time.sleep(0.1)
        channel.close()
        return (tokens_1 - tokens_0) / (at_1 - at_0), at_1 - at_0, int(tokens_1 - tokens_0)
    finally:
        stop_all(*workers, scheduler.proc)


def cmd_overlap(args) -> None:
    ideal = args.workers * args.batch / (args.step_ms / 1000)
    print(f"{args.workers} scripted worker processes, --step-ms {args.step_ms:g}, "
          f"{args.batch} sequences each ({args.max_new_tokens} new tokens); steady-state "
          f"tokens/s from the scheduler's generation_tokens_total over the middle half of "
          f"the run; engine-only ideal: {args.workers} x {args.batch} tokens every "
          f"{args.step_ms:g} ms = {ideal:.0f} tokens/s {load_note()}")
    rows = []
    for label, overlap in (("in turn (--no-overlap)", False), ("overlapped (default)", True)):
        rate, seconds, tokens = _overlap_run(args, overlap)
        rows.append([label, tokens, f"{seconds:.2f}", f"{rate:.0f}", f"{rate / ideal:.2f}"])
    table(["", "tokens measured", "over s", "tokens/s", "vs ideal"], rows)


# ====================================================================== idle


async def _idle(scheduler: Scheduler, args) -> list[list]:
    [ch] = channels(scheduler.target, 1)
    stub = pb_grpc.SchedulerStub(ch)
    workers = [FakeWorker(ch, f"idle{i}", session=True) for i in range(args.workers)]
    for w in workers:
        await w.register(8, 8)
    rows = []
    cpu, wall = scheduler.proc.cpu_seconds(), time.perf_counter()
    await asyncio.sleep(args.seconds)
    rows.append(["no workers calling", "-", _cores(scheduler, cpu, wall), "-", "-"])

    async def poll(w: FakeWorker, end: float, idle_wait_ms: int, pause: float) -> int:
        calls = 0
        while time.perf_counter() < end:
            await w.select(pb.SelectBatchRequest(worker_id=w.worker_id, kv_free_pages=1_000_000,
                                                 gdn_free_slots=8, idle_wait_ms=idle_wait_ms))
            calls += 1
            if pause:
                await asyncio.sleep(pause)
        return calls

    for label, idle_wait_ms, pause in (("polling every 10 ms (before)", 0, 0.01),
                                       ("long poll, idle_wait_ms 1000", 1000, 0.0)):
        cpu, wall = scheduler.proc.cpu_seconds(), time.perf_counter()
        end = wall + args.seconds
        calls = await asyncio.gather(*(poll(w, end, idle_wait_ms, pause) for w in workers))
        rows.append([f"{args.workers} idle workers, {label}",
                     f"{sum(calls) / (time.perf_counter() - wall):.0f}",
                     _cores(scheduler, cpu, wall), "-", "-"])

    # A Submit reaching one of the parked workers: from sending it to a worker holding it.
    latencies = []
    got: asyncio.Queue = asyncio.Queue()
    stop = asyncio.Event()

    async def park(w: FakeWorker) -> None:
        while not stop.is_set():
            decision = await w.select(pb.SelectBatchRequest(
                worker_id=w.worker_id, kv_free_pages=1_000_000, gdn_free_slots=8,
                idle_wait_ms=1000, running=w.running))
            if decision.prefill:
                await got.put(time.perf_counter())
                w.running = []          # it "finished" at once: report nothing next time
                await w.select(pb.SelectBatchRequest(
                    worker_id=w.worker_id, kv_free_pages=1_000_000, gdn_free_slots=8,
                    finished=[pb.FinishedSequence(seq_id=c.seq_id, reason=2)
                              for c in decision.prefill]))

    parked = [asyncio.create_task(park(w)) for w in workers]
    await asyncio.sleep(0.5)
    request = pb.SubmitRequest(prompt_token_ids=PROMPT, max_new_tokens=1)
    for _ in range(args.submits):
        sent = time.perf_counter()
        await stub.Submit(request, timeout=RPC_TIMEOUT)
        latencies.append(await asyncio.wait_for(got.get(), RPC_TIMEOUT) - sent)
        await asyncio.sleep(0.02)
    stop.set()
    await asyncio.gather(*parked, return_exceptions=True)
    rows.append([f"Submit -> a parked worker holds it ({args.submits} submits)", "-", "-",
                 ms(statistics.median(latencies)), ms(pct(latencies, 99))])
    for w in workers:
        await w.close()
    await ch.close()
    return rows


def _cores(scheduler: Scheduler, cpu_before: float, wall_before: float) -> str:
    used = scheduler.proc.cpu_seconds() - cpu_before
    return f"{100 * used / (time.perf_counter() - wall_before):.1f}%"


def cmd_idle(args) -> None:
    print(f"idle cost: {args.workers} workers with nothing to run (sessions), the "
          f"scheduler's CPU from /proc over {args.seconds:g} s per row {load_note()}")
    scheduler = start_scheduler()
    try:
        rows = asyncio.run(_idle(scheduler, args))
    finally:
        scheduler.proc.stop()
    table(["", "calls/s", "scheduler CPU (of one core)", "p50 ms", "p99 ms"], rows)


# ====================================================================== submits


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
    for c in chans:
        await c.close()
    return len(latencies), latencies


def cmd_submits(args) -> None:
    tmp_root = Path(args.tmp_dir).resolve()
    tmp_root.mkdir(parents=True, exist_ok=True)
    print(f"acknowledged Submits/s: {args.submitters} concurrent submitters for "
          f"{args.seconds:g} s, --state-dir on {tmp_root} (ext4 here) {load_note()}")
    rows = []
    runs = [(label, root, fsync) for label, root, _ in _versions(args) for fsync in ("acks",)]
    runs += [("this scheduler", ROOT, "never"), ("this scheduler, no --state-dir", ROOT, "")]
    for label, root, fsync in runs:
        with tempfile.TemporaryDirectory(dir=tmp_root) as state:
            flags = ("--state-dir", state, "--state-fsync", fsync) if fsync else ()
            scheduler = start_scheduler("--max-queue", "10000000", *flags, root=root)
            try:
                count, latencies = asyncio.run(_submits(scheduler.target, args.submitters,
                                                        args.seconds))
                fsyncs = scheduler.metric("lattice_scheduler_state_fsyncs_total")
            finally:
                scheduler.proc.stop()
        rows.append([label, fsync or "-", count, f"{count / args.seconds:.0f}",
                     ms(statistics.median(latencies)), ms(pct(latencies, 99)),
                     f"{fsyncs:.0f}" if fsyncs else "-"])
    table(["", "fsync", "acknowledged", "per s", "p50 ms", "p99 ms", "fsyncs"], rows)


# ====================================================================== report-cost


def _nano_cpu_per_decision(directory: str, batch: int, decisions: int = 200) -> float:
    from bench import decision_cost
    return decision_cost.cpu_per_decision("nano", batch, decisions, Path(directory))


def cmd_report_cost(args) -> None:
    """The scheduler process's CPU per report of one scripted worker decoding --batch
    sequences on a session (issue 21): from /proc (utime + stime) over --seconds of
    steady decoding, the scheduler's idle CPU over the same wall time subtracted. With
    --before, the other checkout's scheduler and worker first, in the same run."""
    print(f"1 scripted worker (--step-ms {args.step_ms:g}, a session), {args.batch} sequences "
          f"decoding; the scheduler's CPU from /proc over {args.seconds:g} s, its idle CPU "
          f"(measured first, {args.idle_seconds:g} s) subtracted {load_note()}")
    rows = [[label, *_report_cost(args, root)] for label, root, _ in _versions(args)]
    if args.floor:
        rows += _floor_rows(args)
    if args.nano_vllm:
        nano = _nano_cpu_per_decision(args.nano_vllm, args.batch)
        rows.append(["nano-vllm schedule()+postprocess()", "200", f"{args.batch}",
                     f"{nano * 1e3:.3f}", "-"])
        for row in rows[:-1]:
            print(f"ratio, {row[0]}: {float(row[3]) / (nano * 1e3):.1f}x nano-vllm's CPU "
                  "per decision")
    table(["", "reports", "tokens/report", "CPU ms each", "idle (of a core)"], rows)


def _report_cost(args, root: Path) -> list[str]:
    """One version's row: reports, tokens per report, CPU ms per report, idle CPU."""
    scheduler = start_scheduler("--max-batch-size", str(args.batch), root=root)
    workers: list[Proc] = []
    try:
        cpu, wall = scheduler.proc.cpu_seconds(), time.perf_counter()
        time.sleep(args.idle_seconds)
        idle_cores = (scheduler.proc.cpu_seconds() - cpu) / (time.perf_counter() - wall)
        workers = start_scripted_workers(
            scheduler, 1, "--step-ms", str(args.step_ms), "--max-batch-size", str(args.batch),
            "--gdn-slots", str(args.batch), "--kv-pages", "100000", root=root)
        channel = grpc.insecure_channel(scheduler.target)
        stub = pb_grpc.SchedulerStub(channel)
        wait_until(lambda: len(stub.GetStatus(pb.GetStatusRequest(), timeout=10).workers) >= 1,
                   "the scripted worker to register", 60, every_seconds=0.2)
        request = pb.SubmitRequest(prompt_token_ids=PROMPT, max_new_tokens=args.max_new_tokens)
        for _ in range(args.batch):
            stub.Submit(request, timeout=RPC_TIMEOUT)
        tokens = "lattice_scheduler_generation_tokens_total"
        reports = "lattice_scheduler_select_batch_duration_seconds_count"
        # Steady state: every sequence admitted and decoding for a while.
        wait_until(lambda: scheduler.metric(tokens) >= 20 * args.batch,
                   "the worker to decode its batch", 120, every_seconds=0.2)
        count_0, tokens_0 = scheduler.metric(reports), scheduler.metric(tokens)
        cpu, wall = scheduler.proc.cpu_seconds(), time.perf_counter()
        time.sleep(args.seconds)
        cpu_1, wall_1 = scheduler.proc.cpu_seconds(), time.perf_counter()
        count, decoded = scheduler.metric(reports) - count_0, scheduler.metric(tokens) - tokens_0
        channel.close()
    finally:
        stop_all(*workers, scheduler.proc)
    if decoded >= args.batch * (args.max_new_tokens - 20):
        raise SystemExit("the sequences finished inside the window: raise --max-new-tokens")
    busy = (cpu_1 - cpu) - idle_cores * (wall_1 - wall)
    per_report = busy / count
    return [f"{count:.0f}", f"{decoded / count:.1f}", f"{per_report * 1e3:.3f}",
            f"{idle_cores * 100:.1f}%"]


# The floor (--floor): the same client against servicers that decide nothing.
FLOOR_WORKER = "floor-0"


def _floor_rows(args) -> list[list[str]]:
    """Rows of one in-process worker on a session, paced like the scripted one (a report,
    its answer, --step-ms), reporting --batch running sequences with a token each in the
    project's worker's form (packed tokens, the running list left out when unchanged):
    to a bare echo servicer without interceptors, with the scheduler's, with the
    bearer-token check too, and to this scheduler, so that the rows differ only in what
    answers."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        token = secrets.token_urlsafe(24)
        tokens_path = Path(tmp) / "tokens.toml"
        tokens_path.write_text(f'[[tokens]]\ntoken = "{token}"\nrole = "worker"\n'
                               f'worker_id = "{FLOOR_WORKER}"\n')
        for label, which, metadata in (
                ("echo servicer, no interceptors", "none", ()),
                ("echo servicer, the scheduler's interceptors", "default", ()),
                ("echo servicer, interceptors and --auth-tokens", "auth",
                 (("authorization", f"Bearer {token}"),))):
            proc = Proc([sys.executable, "-m", "bench.traffic", "echo-server", "--new-form",
                         "--interceptors", which, "--tokens", str(tokens_path)])
            try:
                target = f"{LOOPBACK}:{proc.wait_listening(ECHO_LISTENING).group(1)}"
                rows.append([f"{label} (in-process worker)",
                             *_paced_cost(args, proc, target, metadata, echo=True)])
            finally:
                proc.stop()
    scheduler = start_scheduler("--max-batch-size", str(args.batch))
    try:
        rows.append(["this scheduler (in-process worker)",
                     *_paced_cost(args, scheduler.proc, scheduler.target, (), echo=False)])
    finally:
        scheduler.proc.stop()
    return rows


def _paced_cost(args, proc: Proc, target: str, metadata, echo: bool) -> list[str]:
    """A row of `_report_cost`'s columns for `proc` serving one paced in-process worker."""
    cpu, wall = proc.cpu_seconds(), time.perf_counter()
    time.sleep(args.idle_seconds)
    idle_cores = (proc.cpu_seconds() - cpu) / (time.perf_counter() - wall)
    count, busy = asyncio.run(_paced_session(args, proc, target, metadata, echo, idle_cores))
    return [f"{count}", f"{args.batch:.1f}", f"{busy / count * 1e3:.3f}",
            f"{idle_cores * 100:.1f}%"]


async def _paced_session(args, proc: Proc, target: str, metadata, echo: bool,
                         idle_cores: float) -> tuple[int, float]:
    """(reports, the server's CPU seconds over them less its idle CPU) over --seconds."""
    [ch] = channels(target, 1)
    worker = FakeWorker(ch, FLOOR_WORKER, session=True, metadata=metadata, worker_form=True)
    await worker.register(args.batch, args.batch)
    if echo:
        worker.running = list(range(1, args.batch + 1))
        for seq_id in worker.running:
            worker._pending.admitted(seq_id)
    else:
        await submit_many(pb_grpc.SchedulerStub(ch), args.batch, args.max_new_tokens)
        for _ in range(100):
            if len(worker.running) >= args.batch:
                break
            await worker.admit(args.batch)
        if len(worker.running) < args.batch:
            raise SystemExit(f"the scheduler admitted {len(worker.running)} of {args.batch}")
    step = args.step_ms / 1000
    await iterate_for([worker], 2.0, args.batch, step_seconds=step)  # steady state first
    cpu, wall = proc.cpu_seconds(), time.perf_counter()
    latencies = await iterate_for([worker], args.seconds, args.batch, step_seconds=step)
    busy = (proc.cpu_seconds() - cpu) - idle_cores * (time.perf_counter() - wall)
    await worker.close()
    await ch.close()
    return len(latencies), busy


# ====================================================================== entry point


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, fn: Callable, help_text: str, **defaults) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(fn=fn)
        for key, value in defaults.items():
            p.add_argument("--" + key.replace("_", "-"), type=type(value), default=value)
        p.add_argument("--before", metavar="DIR",
                       help="also run the scheduler of another checkout (rows 'before')")
        return p

    add("streams", cmd_streams, "idle Generate streams next to iterating workers",
        streams=10_000, workers=16, batch=32, seconds=10.0, step_ms=0.0)
    add("honest", cmd_honest, "streams read to the end with scripted workers",
        streams=2000, workers=4, batch=256, max_new_tokens=32, timeout=120.0)
    add("watch", cmd_watch, "unauthenticated Health.Watch streams, tokens on",
        watchers=1000, workers=4, batch=32, seconds=10.0)
    add("decisions", cmd_decisions, "decisions/s: echo floor, unary, session",
        workers=64, batch=4, seconds=5.0, rounds=3)
    add("overlap", cmd_overlap, "scripted workers with step time: overlap on and off",
        workers=8, batch=16, step_ms=10.0, max_new_tokens=300)
    add("idle", cmd_idle, "idle workers: scheduler CPU, Submit to a parked worker",
        workers=16, seconds=20.0, submits=200)
    cost = add("report-cost", cmd_report_cost,
               "scheduler CPU per report, 1 scripted worker decoding --batch on a session",
               batch=256, step_ms=10.0, seconds=10.0, idle_seconds=5.0, max_new_tokens=3000)
    cost.add_argument("--nano-vllm", metavar="DIR",
                      help="a nano-vllm checkout: its CPU per decision in the same run")
    cost.add_argument("--floor", action="store_true",
                      help="also an in-process worker against bare echo servicers (with "
                      "and without the interceptors) and this scheduler")
    add("submits", cmd_submits, "acknowledged Submits/s with concurrent submitters",
        submitters=16, seconds=10.0, tmp_dir=".artifacts")
    echo = sub.add_parser("echo-server", help="(internal) the bare echo servicer")
    echo.add_argument("--port", type=int, default=0)
    echo.add_argument("--new-form", action="store_true",
                      help="take packed tokens and unchanged running lists")
    echo.add_argument("--interceptors", choices=("none", "default", "auth"), default="none")
    echo.add_argument("--tokens", help="the tokens file, for --interceptors auth")
    echo.set_defaults(fn=cmd_echo_server)
    args = parser.parse_args(argv)
    args.fn(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
