"""Processes the benchmarks start and read: a scheduler (this checkout's or another's),
scripted workers, each with its log in a temporary file; their CPU time and memory from
/proc, and the scheduler's metrics from its port."""

from __future__ import annotations

import os
import sys
import tempfile
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from common.processes import LOOPBACK, SCHEDULER_LISTENING, Process, clean_env, scheduler_argv
from common.waiting import wait_until
from lattice.scheduler.v1 import scheduler_pb2 as pb

# The repository root: the processes run from here, where `python -m service` and
# `python -m bench.X` import this checkout.
ROOT = Path(__file__).resolve().parents[2]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: Iterable[int]) -> float:
    """utime + stime of the processes, from /proc; one that has gone counts nothing."""
    ticks = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks / CLOCK_TICKS


def cpu_seconds_single_threaded(pids: Iterable[int]) -> float:
    """CPU time of single-threaded processes (PostgreSQL's) in nanoseconds where the
    kernel keeps schedstat (a process's file counts its main thread only), else as
    `cpu_seconds`; one that has gone counts nothing."""
    total = 0.0
    for pid in pids:
        try:
            total += int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9
        except (OSError, IndexError, ValueError):
            total += cpu_seconds([pid])
    return total


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def scrape(
    metrics_port: int,
    timeout_seconds: float = 5.0,
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample on a scheduler's metrics port: (name, sorted labels) -> value."""
    url = f"http://{LOOPBACK}:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=timeout_seconds) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def python_env(root: Path = ROOT) -> dict[str, str]:
    """The environment of a process of the checkout at `root`: another checkout's code
    comes first on its path, so that its `python -m service` is that checkout's."""
    env = clean_env()
    if root != ROOT:
        env["PYTHONPATH"] = f"{root}{os.pathsep}{root / 'protos'}"
    return env


class Proc(Process):
    """A started process, its output in a temporary file, and /proc readings of it."""

    def __init__(self, argv: list[str], cwd: Path = ROOT, env: dict | None = None) -> None:
        log = tempfile.NamedTemporaryFile(prefix="bench_", suffix=".log", delete=False)
        log.close()
        super().__init__(
            " ".join(argv[1:4]), argv, Path(log.name), cwd=cwd, env=env or python_env()
        )

    def rss_bytes(self) -> int:
        return rss_bytes(self.popen.pid)

    def cpu_seconds(self) -> float:
        return cpu_seconds([self.popen.pid])

    def stop(self) -> None:
        super().stop(10)
        self.log_path.unlink(missing_ok=True)


def stop_all(*procs: Proc) -> None:
    for p in procs:
        p.stop()


@dataclass
class Scheduler:
    """A `lattice-scheduler serve` process on loopback and what its metrics say."""

    proc: Proc
    port: int
    metrics_port: int

    @property
    def target(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def metric(self, name: str) -> float:
        return sum(self.samples(name).values())

    def samples(self, name: str) -> dict[tuple, float]:
        return {
            labels: value
            for (sample, labels), value in scrape(self.metrics_port, timeout_seconds=10).items()
            if sample == name
        }

    def histogram(self) -> dict[float, float]:
        """SelectBatch's histogram now: cumulative count per upper bound (seconds)."""
        return {
            float(dict(labels)["le"]): value
            for labels, value in self.samples(
                "lattice_scheduler_select_batch_duration_seconds_bucket"
            ).items()
        }


def start_scheduler(*flags: str, root: Path = ROOT) -> Scheduler:
    """A scheduler process of the checkout at `root`, once it listens; leases of 10 minutes,
    as fake workers may pause between phases."""
    proc = Proc(
        scheduler_argv("--log-level", "WARNING", "--lease-ttl-ms", "600000", *flags),
        cwd=root,
        env=python_env(root),
    )
    proc.wait_listening(SCHEDULER_LISTENING)
    return Scheduler(proc, *proc.ports)


def start_scripted_workers(
    scheduler: Scheduler, count: int, *flags: str, root: Path = ROOT
) -> list[Proc]:
    """`count` `lattice-worker --model scripted` processes, worker ids scripted-0...; see
    `wait_for_workers`."""
    return [
        Proc(
            [
                sys.executable,
                "-m",
                "worker_client",
                "--scheduler",
                scheduler.target,
                "--worker-id",
                f"scripted-{i}",
                "--model",
                "scripted",
                "--log-format",
                "json",
                *flags,
            ],
            cwd=root,
            env=python_env(root),
        )
        for i in range(count)
    ]


def wait_for_workers(stub, count: int, timeout_seconds: float = 60.0) -> None:
    """Until the scheduler behind `stub` (a SchedulerStub) knows `count` workers."""
    wait_until(
        lambda: len(stub.GetStatus(pb.GetStatusRequest(), timeout=10).workers) >= count,
        f"{count} worker(s) to register",
        timeout_seconds,
        every_seconds=0.2,
    )


def checkouts(before: str | None) -> list[tuple[str, Path]]:
    """(label, root) of the schedulers to compare: this checkout, after `before`'s when
    given (another checkout, e.g. a worktree of the commit before a change)."""
    found = [("this scheduler", ROOT)]
    if before:
        found.insert(0, ("before", Path(before).resolve()))
    return found
