"""The processes of a gateway test stack, started as outside tools start them: scheduler,
worker and gateway on loopback, each logging to a file, every wait bounded."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = "127.0.0.1"
START_TIMEOUT_SECONDS = 60.0  # a worker imports torch and loads a model: slow on a busy machine
SCHEDULER_LISTENING = re.compile(r"listening on 127\.0\.0\.1:(\d+) \(metrics on "
                                 r"http://127\.0\.0\.1:(\d+)/")
GATEWAY_LISTENING = re.compile(r"gateway listening on http://127\.0\.0\.1:(\d+) ")


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LATTICE_SCHEDULER_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class Process:
    """A started process and its log."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    ports: tuple[int, ...] = field(default=())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)


def spawn(name: str, argv: list[str], log_dir: Path,
          listening: re.Pattern | None = None) -> Process:
    """Start `argv`; with `listening`, wait until its log shows the pattern (ports read from
    its groups)."""
    log_path = log_dir / f"{name}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=clean_env(), stdout=log,
                                stderr=subprocess.STDOUT)
    process = Process(name, proc, log_path)
    if listening is not None:
        match = wait_for(lambda: listening.search(process.log()), f"{name} to listen",
                         process=process)
        process.ports = tuple(int(g) for g in match.groups())
    return process


def wait_for(probe: Callable, what: str, timeout: float = START_TIMEOUT_SECONDS,
             process: Process | None = None, every: float = 0.1):
    """probe()'s first truthy value; fails naming `what` (and the process's log, if it died)."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if process is not None and process.proc.poll() is not None:
            pytest.fail(f"{process.name} exited with {process.proc.returncode} while waiting "
                        f"for {what}:\n{process.log()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout:g} s for {what}")
        time.sleep(every)


def scheduler_argv(*flags: str) -> list[str]:
    return [sys.executable, "-m", "service", "serve", "--host", LOOPBACK, "--port", "0",
            "--metrics-port", "0", *flags]


def worker_argv(target: str, model_dir: Path, worker_id: str = "gateway-test-worker") -> list[str]:
    return [sys.executable, "-m", "worker_client", "--scheduler", target, "--worker-id",
            worker_id, "--model", str(model_dir), "--device", "cpu", "--threads", "1"]


def gateway_argv(target: str, model_dir: Path, *flags: str) -> list[str]:
    """Exactly the flags outside tools use, plus `flags`."""
    return [sys.executable, "-m", "service", "gateway", "--target", target, "--model",
            str(model_dir), "--host", LOOPBACK, "--port", "0", *flags]
