"""`scripts/run_local.sh` stops every process it started on SIGTERM, SIGINT and SIGHUP,
also when a script started it in the background (where a shell ignores SIGINT for it)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from common.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # starts a scheduler, a worker and a gateway


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize(
    "signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: signal.Signals(s).name
)
def test_run_local_started_in_the_background_stops_everything_on_a_signal(signum, tmp_path):
    log = tmp_path / "stack.log"
    ports = [str(free_port()) for _ in range(3)]
    # A script that starts the stack in the background, as CI or a wrapper would.
    launcher = subprocess.run(
        [
            "bash",
            "-c",
            f"scripts/run_local.sh --model scripted --workers 1 --requests 1 "
            f"--concurrency 1 --max-new-tokens 4 --port {ports[0]} "
            f"--metrics-port {ports[1]} --gateway-port {ports[2]} "
            f"--state-dir {tmp_path / 'state'} > {log} 2>&1 & echo $!",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    stack_pid = int(launcher.stdout.strip())
    started: set[int] = set()
    try:
        deadline = time.monotonic() + 240
        while "the stack keeps running" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            assert _alive(stack_pid), log.read_text()[-2000:]
            time.sleep(0.5)
        started = _descendants(stack_pid)
        assert len(started) >= 3, started  # scheduler, worker, gateway
        os.kill(stack_pid, signum)
        deadline = time.monotonic() + 60
        while _alive(stack_pid) or any(map(_alive, started)):
            assert time.monotonic() < deadline, (
                f"still running after {signal.Signals(signum).name}: "
                f"{[p for p in [stack_pid, *started] if _alive(p)]}"
            )
            time.sleep(0.2)
    finally:
        for pid in [stack_pid, *started]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
