"""Processes that tests and scripts start: a scheduler, a gateway, a worker, each logging
to its own file, every wait bounded.

The banners the scheduler and the gateway print once they listen are matched here and
nowhere else (service/server/app.py and service/gateway/server.py print them).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

from common.waiting import WaitFailed, wait_until

LOOPBACK = "127.0.0.1"
# `lattice-scheduler serve` on loopback: groups (gRPC port, metrics port).
SCHEDULER_LISTENING = re.compile(
    r"listening on 127\.0\.0\.1:(\d+) \(metrics on http://127\.0\.0\.1:(\d+)/"
)
# `lattice-scheduler gateway` on loopback: group (HTTP port).
GATEWAY_LISTENING = re.compile(r"gateway listening on http://127\.0\.0\.1:(\d+) ")
START_TIMEOUT_SECONDS = 60.0  # a worker imports torch and loads a model: slow on a busy machine


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without LATTICE_SCHEDULER_* settings, unbuffered, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LATTICE_SCHEDULER_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def free_port() -> int:
    """A loopback port nothing listens on now (another process may take it; rarely does)."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def scheduler_argv(*flags: str, port: int = 0) -> list[str]:
    """`serve` on loopback, on `port` (0: a free one) and a free metrics port."""
    return [
        sys.executable,
        "-m",
        "service",
        "serve",
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        "--metrics-port",
        "0",
        *flags,
    ]


# A reference-engine worker on one CPU thread (tests and benchmarks that start several).
CPU_ONE_THREAD = ("--device", "cpu", "--threads", "1")


def worker_argv(
    target: str, worker_id: str, model: str | Path, *flags: str, python: str | Path = ""
) -> list[str]:
    """`lattice-worker` for `model` (a checkpoint directory, `demo` or `scripted`) calling
    `target`, plus `flags`; run by `python` (default: this interpreter; a vLLM worker runs
    in its own environment's)."""
    return [
        str(python or sys.executable),
        *("-m", "worker_client", "--scheduler", target, "--worker-id", worker_id),
        *("--model", str(model), *flags),
    ]


def gateway_argv(target: str, model: str | Path, *flags: str, port: int = 0) -> list[str]:
    """`lattice-scheduler gateway` for `target` on loopback, on `port` (0: a free one, which
    its banner names: GATEWAY_LISTENING), tokenizing with `model`'s files, plus `flags`."""
    return [
        *(sys.executable, "-m", "service", "gateway", "--target", target),
        *("--model", str(model), "--host", LOOPBACK, "--port", str(port), *flags),
    ]


class Process:
    """One started process, its stdout and stderr in a log file, and how it ended."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        *,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
        new_session: bool = False,
    ) -> None:
        """`new_session`: its own process group, so a signal to ours does not reach it."""
        self.name, self.log_path = name, Path(log_path)
        self.ports: tuple[int, ...] = ()  # what its banner said, once `wait_listening` saw it
        with self.log_path.open("w") as log:  # the child holds its own copy
            self.popen = subprocess.Popen(
                argv,
                cwd=cwd,
                env=env if env is not None else clean_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=new_session,
            )

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError as err:
            return f"<cannot read {self.log_path}: {err}>"

    def wait_for_line(self, pattern: re.Pattern, timeout_seconds: float) -> re.Match | None:
        """The first match of `pattern` in the log, or None once it has exited or time ran
        out without one."""
        try:
            return wait_until(
                lambda: pattern.search(self.log_text()),
                f"{self.name}: {pattern}",
                timeout_seconds,
                every_seconds=0.02,
                gone=self.exit_reason,
            )
        except WaitFailed:
            return pattern.search(self.log_text())  # it may have printed it as it exited

    def wait_listening(
        self, pattern: re.Pattern, timeout_seconds: float = START_TIMEOUT_SECONDS
    ) -> re.Match:
        """Until the log shows `pattern` (a banner); its groups become `ports`. Fails with
        the log's tail if the process exits first or time runs out."""
        match = self.wait_for_line(pattern, timeout_seconds)
        if match is None:
            state = "timed out" if self.alive() else f"exited with {self.popen.returncode}"
            raise WaitFailed(
                f"{self.name} {state} before listening (waited up to "
                f"{timeout_seconds:g} s):\n{self.log_text()[-3000:]}"
            )
        self.ports = tuple(int(g) for g in match.groups())
        return match

    def kill(self) -> None:
        """SIGKILL (no cleanup of any kind), then reap."""
        if self.alive():
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=10)

    def stop(self, timeout_seconds: float = 20.0) -> None:
        """SIGTERM (a graceful stop); SIGKILL if it has not exited after `timeout_seconds`."""
        if self.alive():
            self.popen.terminate()
            try:
                self.popen.wait(timeout_seconds)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout_seconds)

    def exit_reason(self) -> str | None:
        """None while it runs; once it has exited, its code and the tail of its log (for
        `wait_until(..., gone=process.exit_reason)`)."""
        if self.alive():
            return None
        return f"{self.name} exited with {self.popen.returncode}:\n{self.log_text()[-3000:]}"


def spawn(
    name: str,
    argv: list[str],
    log_dir: Path,
    listening: re.Pattern | None = None,
    *,
    timeout_seconds: float = START_TIMEOUT_SECONDS,
    **options,
) -> Process:
    """Start `argv` logging to `log_dir/<name>.log`; with `listening` (a banner), return once
    its log shows it, its ports read from the banner's groups. `options`: Process's."""
    process = Process(name, argv, Path(log_dir) / f"{name}.log", **options)
    if listening is not None:
        try:
            process.wait_listening(listening, timeout_seconds)
        except BaseException:
            process.kill()
            raise
    return process


def spawn_scheduler(
    name: str,
    log_dir: Path,
    *flags: str,
    port: int = 0,
    timeout_seconds: float = START_TIMEOUT_SECONDS,
    **options,
) -> Process:
    """A `serve` process on loopback that printed its banner: `ports` is (gRPC port,
    metrics port)."""
    return spawn(
        name,
        scheduler_argv(*flags, port=port),
        log_dir,
        SCHEDULER_LISTENING,
        timeout_seconds=timeout_seconds,
        **options,
    )
