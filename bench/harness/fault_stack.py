"""Fault harness: a real scheduler process and scripted worker processes, killed on purpose.

`Stack` runs `lattice-scheduler serve --state-dir` on a fixed loopback port and N
`python -m worker_client --model scripted --step-ms` processes; it can kill -9 and
restart the scheduler (same port, same state dir) and kill -9 or restart a worker
under the same id. `Clients` submits sequences with unique request_ids from one thread
and collects every acknowledged sequence's output by re-attaching with `Generate`;
`check` says what went wrong, counted.

Every wait is bounded, and `Stack.close` kills every process it started, whatever
happened. Each process logs to its own file under the stack's directory. Used by
tests/faults, tests/replicas, bench/chaos.py and bench/handoff_kills.py.
"""

from __future__ import annotations

import http.client
import queue
import random
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench.harness.processes import scrape
from common.processes import (
    LOOPBACK,
    SCHEDULER_LISTENING,
    Process,
    clean_env,
    free_port,
    scheduler_argv,
)
from common.waiting import wait_until
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from worker_client.testing import reference_output

START_TIMEOUT_SECONDS = 30.0
RPC_TIMEOUT_SECONDS = 5.0
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# Reconnect quickly after a restart: the default backoff grows to minutes.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]


class Proc(Process):
    """A process of the stack: in its own session (the harness's signals do not reach it),
    killed with SIGKILL."""

    def __init__(self, name: str, argv: list[str], log_path: Path) -> None:
        super().__init__(name, argv, log_path, env=clean_env(), new_session=True)


def kill_all(procs: list[Proc]) -> None:
    """SIGKILL every process, going on past one that fails."""
    for proc in procs:
        try:
            proc.kill()
        except Exception:  # noqa: BLE001 - keep killing the others
            pass


@dataclass
class Restart:
    """One scheduler (re)start: when it began, listened, and finished its first sequence."""

    started_at: float
    listening_at: float | None = None
    first_finish_at: float | None = None


class Stack:
    """A scheduler process on a fixed port with a state dir, and scripted worker processes."""

    def __init__(
        self,
        directory: Path,
        *,
        num_workers: int = 2,
        lease_ttl_ms: int = 2000,
        step_ms: float = 10.0,
        scheduler_flags: tuple[str, ...] = (),
        worker_flags: tuple[str, ...] = (),
    ) -> None:
        self.directory = Path(directory)
        self.state_dir = self.directory / "state"
        self.lease_ttl_ms = lease_ttl_ms
        self.step_ms = step_ms
        self.port = free_port()
        self.target = f"{LOOPBACK}:{self.port}"
        self.metrics_port = 0
        self._scheduler_flags = scheduler_flags
        self._worker_flags = worker_flags
        self.scheduler: Proc | None = None
        self.workers: dict[str, Proc] = {}
        self.all_procs: list[Proc] = []
        self.restarts: list[Restart] = []  # restarts[0] is the first start
        self.scheduler_kills = 0
        self.worker_kills = 0
        self.worker_restarts = 0
        self._watch_stop = threading.Event()
        self.channel = grpc.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.SchedulerStub(self.channel)
        self.worker_ids = [f"w{i + 1}" for i in range(num_workers)]

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Stack:
        self.start_scheduler()
        for worker_id in self.worker_ids:
            self.start_worker(worker_id)
        self.wait_workers(len(self.worker_ids))
        return self

    def close(self) -> None:
        """Kill every process ever started here (idempotent)."""
        self._watch_stop.set()
        kill_all(self.all_procs)
        self.channel.close()

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ scheduler

    def start_scheduler(self) -> None:
        """Start the scheduler on self.port and the state dir; returns once it listens."""
        assert self.scheduler is None or not self.scheduler.alive(), "scheduler already up"
        restart = Restart(started_at=time.monotonic())
        self.restarts.append(restart)
        for attempt in range(3):
            number = len(self.restarts) - 1
            proc = Proc(
                f"scheduler.{number}.{attempt}",
                scheduler_argv(
                    "--state-dir",
                    str(self.state_dir),
                    "--lease-ttl-ms",
                    str(self.lease_ttl_ms),
                    *self._scheduler_flags,
                    port=self.port,
                ),
                self.directory / f"scheduler.{number}.{attempt}.log",
            )
            self.all_procs.append(proc)
            self.scheduler = proc
            match = proc.wait_for_line(SCHEDULER_LISTENING, START_TIMEOUT_SECONDS)
            if match is not None:
                break
            proc.kill()
            if not any(s in proc.log_text() for s in ("cannot listen", "already in use")):
                raise AssertionError(f"{proc.name} did not start:\n{proc.log_text()}")
            time.sleep(0.5)  # the port is still held by the killed process: once more
        else:
            raise AssertionError(f"scheduler could not listen on port {self.port}")
        restart.listening_at = time.monotonic()
        grpc.channel_ready_future(self.channel).result(timeout=START_TIMEOUT_SECONDS)
        self.metrics_port = int(match.group(2))
        threading.Thread(
            target=self._watch_first_finish, args=(proc, restart, self.metrics_port), daemon=True
        ).start()

    def kill_scheduler(self) -> None:
        assert self.scheduler is not None and self.scheduler.alive(), "scheduler is not up"
        self.scheduler.kill()
        self.scheduler_kills += 1

    def restart_scheduler(self) -> None:
        """kill -9, then start again at once on the same port and state dir."""
        self.kill_scheduler()
        self.start_scheduler()

    def _watch_first_finish(self, proc: Proc, restart: Restart, metrics_port: int) -> None:
        """Record when this incarnation first counts a finished sequence (not a cancel)."""
        while proc.alive() and not self._watch_stop.is_set():
            try:
                if self._finished_count(metrics_port) > 0:
                    restart.first_finish_at = time.monotonic()
                    return
            except (OSError, http.client.HTTPException):  # killed mid-answer
                pass
            time.sleep(0.02)

    # ------------------------------------------------------------------ workers

    def start_worker(self, worker_id: str, *, beside_the_running_one: bool = False) -> None:
        """Start a worker process; under an id used before, that counts as a restart.

        `beside_the_running_one`: start it while the old process under this id still
        runs (a misconfiguration: two processes sharing one worker_id).
        """
        old = self.workers.get(worker_id)
        assert beside_the_running_one or old is None or not old.alive(), (
            f"{worker_id} is already running"
        )
        if old is not None and not beside_the_running_one:
            self.worker_restarts += 1
        number = sum(p.name.startswith(worker_id + ".") for p in self.all_procs)
        proc = Proc(
            f"{worker_id}.{number}",
            [
                sys.executable,
                "-m",
                "worker_client",
                "--scheduler",
                self.target,
                "--worker-id",
                worker_id,
                "--model",
                "scripted",
                "--step-ms",
                str(self.step_ms),
                *self._worker_flags,
            ],
            self.directory / f"{worker_id}.{number}.log",
        )
        self.all_procs.append(proc)
        self.workers[worker_id] = proc

    def freeze(self, proc: Proc, seconds: float) -> None:
        """SIGSTOP `proc` for `seconds`, then SIGCONT: a stall (GC, VM pause, slow disk)."""
        proc.popen.send_signal(signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            proc.popen.send_signal(signal.SIGCONT)

    def kill_worker(self, worker_id: str) -> None:
        proc = self.workers[worker_id]
        assert proc.alive(), f"{worker_id} is not running:\n{proc.log_text()}"
        proc.kill()
        self.worker_kills += 1

    def restart_worker(self, worker_id: str) -> None:
        """kill -9, then start a new process under the same id at once."""
        self.kill_worker(worker_id)
        self.start_worker(worker_id)

    def wait_workers(self, count: int, timeout: float = START_TIMEOUT_SECONDS) -> None:
        """Until `count` workers are registered and each has made a SelectBatch call."""

        def ready() -> bool:
            for proc in self.workers.values():
                assert proc.alive() or proc.popen.returncode == -signal.SIGKILL, (
                    f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log_text()}"
                )
            workers = self.stub.GetStatus(
                pb.GetStatusRequest(), timeout=RPC_TIMEOUT_SECONDS
            ).workers
            return sum(w.iteration > 0 for w in workers) >= count

        wait_until(
            ready, f"{count} workers calling SelectBatch", timeout, retry_on=(grpc.RpcError,)
        )

    def worker_status(self) -> dict[str, pb.WorkerStatus]:
        status = self.stub.GetStatus(pb.GetStatusRequest(), timeout=RPC_TIMEOUT_SECONDS)
        return {w.worker_id: w for w in status.workers}

    # ------------------------------------------------------------------ metrics

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The current scheduler's samples: (name, sorted labels) -> value."""
        return scrape(self.metrics_port, timeout_seconds=2.0)

    def _finished_count(self, metrics_port: int) -> float:
        return sum(
            v
            for (name, labels), v in scrape(metrics_port, timeout_seconds=2.0).items()
            if name == "lattice_scheduler_finished_total"
            and dict(labels).get("reason") != "cancelled"
        )

    def log_tails(self, max_lines: int = 150) -> str:
        parts = []
        for proc in self.all_procs:
            lines = proc.log_text().splitlines()
            parts.append(f"----- {proc.name} ({len(lines)} lines, last {max_lines}) -----")
            parts.extend(lines[-max_lines:])
        return "\n".join(parts)


# ====================================================================== clients


@dataclass
class Job:
    """One sequence a client wants, and what the scripted model must produce for it."""

    request_id: str
    prompt: list[int]
    max_new_tokens: int
    stop_token_ids: list[int]
    expected_tokens: list[int]
    expected_reason: int  # pb.FinishReason
    # Filled in as the run goes:
    first_sent_at: float | None = None
    acknowledged_at: float | None = None
    seq_id: int | None = None
    tokens: list[int] = field(default_factory=list)
    finish_reason: int | None = None
    finished_at: float | None = None
    attachments: int = 0
    problems: list[str] = field(default_factory=list)

    def request(self) -> pb.SubmitRequest:
        return pb.SubmitRequest(
            request_id=self.request_id,
            prompt_token_ids=self.prompt,
            max_new_tokens=self.max_new_tokens,
            stop_token_ids=self.stop_token_ids,
        )


def make_jobs(
    count: int,
    seed: int,
    prefix: str = "job",
    max_new_tokens_range: tuple[int, int] = (8, 40),
    shared_prefix: int = 0,
) -> list[Job]:
    """`count` sequences; about a third stop early on a stop token (finish reason STOP).
    `shared_prefix`: every prompt starts with the same this many tokens (a system prompt
    a worker's prefix cache shares)."""
    rng = random.Random(seed)
    common = [rng.randrange(1000) for _ in range(shared_prefix)]
    jobs = []
    for i in range(count):
        prompt = common + [rng.randrange(1000) for _ in range(rng.randint(3, 40))]
        max_new_tokens = rng.randint(*max_new_tokens_range)
        stop_token_ids: list[int] = []
        if i % 3 == 2:
            # One of the tokens it would generate, so that it really stops there.
            full = reference_output(prompt, max_new_tokens)
            stop_token_ids = [full[rng.randrange(len(full) // 2, len(full))]]
        expected = reference_output(prompt, max_new_tokens, stop_token_ids)
        reason = (
            pb.FINISH_REASON_STOP if expected[-1] in stop_token_ids else pb.FINISH_REASON_MAX_LENGTH
        )
        jobs.append(
            Job(f"{prefix}-{seed}-{i}", prompt, max_new_tokens, stop_token_ids, expected, reason)
        )
    return jobs


class Clients:
    """`num_submitters` submitting threads (taking jobs in turn) and `num_collectors`
    collecting threads, over one channel.

    Submit retries the same request_id on UNAVAILABLE or DEADLINE_EXCEEDED with backoff;
    a job counts as acknowledged only once Submit returned OK. Each acknowledged job is
    then collected by Generate with its request_id (a re-attach), again after every
    UNAVAILABLE, keeping tokens by position: a re-attach streams from token 0, so a
    position already held must repeat the same token, and only later positions are new.
    """

    def __init__(
        self,
        target: str,
        jobs: list[Job],
        *,
        submit_interval_seconds: float = 0.02,
        num_collectors: int = 16,
        deadline_seconds: float = 60.0,
        num_submitters: int = 1,
    ) -> None:
        self.jobs = jobs
        self.deadline = time.monotonic() + deadline_seconds
        self._interval = submit_interval_seconds
        self._channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.SchedulerStub(self._channel)
        self._acked: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self.num_acknowledged = 0
        self.num_submit_retries = 0
        self.num_reattachments = 0
        self._stop = threading.Event()
        self._streams: set = set()  # open Generate calls, cancelled by close()
        self._to_submit = iter(jobs)
        self._submitters_left = num_submitters
        self._threads = [
            threading.Thread(target=self._submit_all, name=f"submitter-{i}", daemon=True)
            for i in range(num_submitters)
        ]
        self._collectors = [
            threading.Thread(target=self._collect_all, name=f"collector-{i}", daemon=True)
            for i in range(num_collectors)
        ]
        self._threads += self._collectors

    def start(self) -> Clients:
        for thread in self._threads:
            thread.start()
        return self

    def close(self) -> None:
        """Stop every thread now (open streams are cancelled) and close the channel."""
        self._stop.set()
        with self._lock:
            streams = list(self._streams)
        for stream in streams:
            stream.cancel()
        end = time.monotonic() + 10.0
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))
        self._channel.close()

    def stop_submitting(self) -> None:
        """Submit no more jobs; those acknowledged are still collected."""
        with self._lock:
            self._to_submit = iter(())

    def running(self) -> bool:
        """Whether the submitter or any collector is still at work."""
        return any(thread.is_alive() for thread in self._threads)

    def wait_acknowledged(self, count: int, timeout: float) -> None:
        wait_until(
            lambda: self.num_acknowledged >= count,
            f"{count} acknowledged submits ({self.num_acknowledged} so far)",
            timeout,
        )

    def wait_done(self, timeout: float) -> None:
        """Until the submitter and every collector have ended (done, failed or timed out)."""
        end = min(self.deadline + 5.0, time.monotonic() + timeout)
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        assert not alive, f"client threads still running after {timeout:g} s: {alive}"

    def acknowledged(self) -> list[Job]:
        return [j for j in self.jobs if j.seq_id is not None]

    # ------------------------------------------------------------------ threads

    def _submit_all(self) -> None:
        try:
            while not self._stop.wait(self._interval):
                with self._lock:
                    job = next(self._to_submit, None)
                if job is None:
                    return
                if self._submit(job):
                    self._acked.put(job)
        finally:
            with self._lock:
                self._submitters_left -= 1
                last = self._submitters_left == 0
            if last:
                for _ in self._collectors:
                    self._acked.put(None)

    def _submit(self, job: Job) -> bool:
        job.first_sent_at = time.monotonic()
        delay = 0.05
        while not self._stop.is_set():
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                job.problems.append("never acknowledged before the deadline")
                return False
            try:
                response = self._stub.Submit(
                    job.request(), timeout=min(RPC_TIMEOUT_SECONDS, remaining)
                )
            except grpc.RpcError as err:
                if err.code() not in RETRYABLE:
                    job.problems.append(f"Submit failed: {err.code().name}: {err.details()}")
                    return False
                with self._lock:
                    self.num_submit_retries += 1
                self._stop.wait(delay * (0.5 + random.random() / 2))
                delay = min(delay * 2, 1.0)
                continue
            job.seq_id, job.acknowledged_at = response.seq_id, time.monotonic()
            with self._lock:
                self.num_acknowledged += 1
            return True
        return False

    def _collect_all(self) -> None:
        while True:
            job = self._acked.get()
            if job is None:
                return
            self._collect(job)

    def _collect(self, job: Job) -> None:
        delay = 0.05
        while not self._stop.is_set():
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                job.problems.append(
                    f"not finished before the deadline "
                    f"({len(job.tokens)} of {len(job.expected_tokens)} tokens)"
                )
                return
            job.attachments += 1
            # A stream that ends by its deadline cancels the sequence: only the run's own
            # deadline may end it.
            stream = self._stub.Generate(job.request(), timeout=remaining)
            with self._lock:
                self._streams.add(stream)
            try:
                if self._attach(job, stream):
                    return
                job.problems.append("stream ended without a finished event")
                return
            except grpc.RpcError as err:
                if self._stop.is_set():
                    return
                if err.code() not in RETRYABLE or time.monotonic() >= self.deadline:
                    job.problems.append(f"Generate failed: {err.code().name}: {err.details()}")
                    return
                with self._lock:
                    self.num_reattachments += 1
                self._stop.wait(delay * (0.5 + random.random() / 2))
                delay = min(delay * 2, 1.0)
            finally:
                with self._lock:
                    self._streams.discard(stream)

    def _attach(self, job: Job, stream) -> bool:
        """Read one stream to its end; True once the finished event arrived."""
        position = 0
        for event in stream:
            if event.seq_id != job.seq_id:
                job.problems.append(
                    f"re-attach by request_id streamed seq_id {event.seq_id}, "
                    f"Submit acknowledged seq_id {job.seq_id}"
                )
            for token in event.token_ids:
                if position < len(job.tokens):
                    if job.tokens[position] != token:
                        job.problems.append(
                            f"token {position} changed on a re-attach: "
                            f"{job.tokens[position]} then {token}"
                        )
                else:
                    job.tokens.append(token)
                position += 1
            if event.finished:
                if job.finish_reason is not None and job.finish_reason != event.finish_reason:
                    job.problems.append("finish reason changed")
                job.finish_reason = event.finish_reason
                job.finished_at = time.monotonic()
                if position != len(job.tokens):
                    job.problems.append(
                        f"finished after {position} tokens on this attachment, "
                        f"{len(job.tokens)} seen before"
                    )
                return True
        return False


# ====================================================================== checks


@dataclass
class Outcome:
    """What a run got wrong, counted; `problems` lists each, for an assertion message."""

    submitted: int = 0
    acknowledged: int = 0
    lost: int = 0
    duplicated_tokens: int = 0
    missing_tokens: int = 0
    wrong_outputs: int = 0
    problems: list[str] = field(default_factory=list)


def check(stub: pb_grpc.SchedulerStub, jobs: list[Job]) -> Outcome:
    """After a run: every acknowledged job is known, FINISHED once with its reference
    tokens (counted), and kept its one seq_id (a repeated Submit returns it again)."""
    outcome = Outcome(submitted=sum(j.first_sent_at is not None for j in jobs))
    acked = [j for j in jobs if j.seq_id is not None]
    outcome.acknowledged = len(acked)
    owners: dict[int, str] = {}
    for job in acked:
        bad = list(job.problems)
        if job.seq_id in owners:
            bad.append(f"seq_id {job.seq_id} also acknowledged for {owners[job.seq_id]}")
        owners[job.seq_id] = job.request_id
        try:
            info = stub.GetSequence(
                pb.GetSequenceRequest(seq_id=job.seq_id), timeout=RPC_TIMEOUT_SECONDS
            )
            again = stub.Submit(job.request(), timeout=RPC_TIMEOUT_SECONDS).seq_id
        except grpc.RpcError as err:
            outcome.lost += 1
            outcome.problems.append(
                f"{job.request_id} (seq_id {job.seq_id}): {err.code().name}: {err.details()}"
            )
            continue
        if again != job.seq_id:
            bad.append(f"a repeated Submit returned seq_id {again}")
        if info.state != pb.SEQUENCE_STATE_FINISHED or job.finish_reason is None:
            # Known but never finished: as lost to its client as an unknown one.
            outcome.lost += 1
            outcome.problems.append(
                f"{job.request_id} (seq_id {job.seq_id}): not finished "
                f"({pb.SequenceState.Name(info.state)}); {bad}"
            )
            continue
        duplicated, missing = count_duplicated_and_missing(job.tokens, job.expected_tokens)
        outcome.duplicated_tokens += duplicated
        outcome.missing_tokens += missing
        if job.tokens != job.expected_tokens or info.generated_tokens != len(job.expected_tokens):
            bad.append(
                f"{len(job.tokens)} tokens streamed, {info.generated_tokens} counted, "
                f"{len(job.expected_tokens)} expected; equal to the reference: "
                f"{job.tokens == job.expected_tokens}"
            )
        if job.finish_reason != job.expected_reason or info.finish_reason != job.expected_reason:
            bad.append(
                f"finish reason {pb.FinishReason.Name(job.finish_reason)} streamed, "
                f"{pb.FinishReason.Name(info.finish_reason)} stored, "
                f"{pb.FinishReason.Name(job.expected_reason)} expected"
            )
        if bad:
            outcome.wrong_outputs += 1
            outcome.problems.extend(f"{job.request_id} (seq_id {job.seq_id}): {p}" for p in bad)
    outcome.problems.extend(
        f"{j.request_id}: {p}" for j in jobs if j.seq_id is None for p in j.problems
    )
    return outcome


def count_duplicated_and_missing(output: list[int], reference: list[int]) -> tuple[int, int]:
    """(tokens delivered again, reference tokens never delivered), aligning `output` on
    `reference`: a run of output tokens that repeats the reference tokens just before
    the current position is a duplicate; at the first other difference the rest of the
    reference counts as missing (the output is wrong from there on anyway)."""
    i = j = duplicated = 0
    while i < len(output) and j < len(reference):
        if output[i] == reference[j]:
            i, j = i + 1, j + 1
            continue
        repeat = next((m for m in range(j, 0, -1) if output[i : i + m] == reference[j - m : j]), 0)
        if repeat == 0:
            break
        duplicated += repeat
        i += repeat
    # Past the reference's end, output tokens repeating its tail are duplicates too.
    while i < len(output) and j == len(reference):
        repeat = next((m for m in range(j, 0, -1) if output[i : i + m] == reference[j - m : j]), 0)
        if repeat == 0:
            break
        duplicated += repeat
        i += repeat
    return duplicated, len(reference) - j


def report_run(outcome: Outcome, table: str, directory: Path, *, keep: bool, kept: str) -> int:
    """A fault run's end: its problems and `table` printed, `directory` removed unless the
    run failed or `keep` (then `kept`, what it holds, is named); the exit status, 1 when
    anything was lost, duplicated, wrong or otherwise a problem."""
    failed = outcome.lost or outcome.duplicated_tokens or outcome.wrong_outputs or outcome.problems
    for problem in outcome.problems[:30]:
        print(f"PROBLEM: {problem}")
    print()
    print(table)
    if failed or keep:
        print(f"\n{kept} kept in {directory}")
    else:
        shutil.rmtree(directory, ignore_errors=True)
    return 1 if failed else 0


def check_known(stub: pb_grpc.SchedulerStub, jobs: list[Job]) -> list[str]:
    """Every job acknowledged so far is known to the scheduler now (GetSequence)."""
    unknown = []
    for job in [j for j in jobs if j.seq_id is not None]:
        try:
            stub.GetSequence(pb.GetSequenceRequest(seq_id=job.seq_id), timeout=RPC_TIMEOUT_SECONDS)
        except grpc.RpcError as err:
            unknown.append(f"{job.request_id} (seq_id {job.seq_id}): {err.code().name}")
    return unknown
