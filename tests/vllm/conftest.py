"""vLLM workers (`lattice-worker --engine vllm`) beside a real scheduler, on a tiny seeded
Qwen3.5 checkpoint that transformers writes, and plain vLLM's answers to compare with.

vLLM runs from `.venv-vllm` (scripts/setup.sh --engine vllm; .ci/run makes it). Without
it these tests skip, saying so; under CI (CI=true) they fail instead: CI must run them.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from common.processes import (
    GATEWAY_LISTENING,
    LOOPBACK,
    Process,
    clean_env,
    gateway_argv,
    spawn,
    worker_argv,
)
from common.waiting import wait_until
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from tests.gateway.checkpoint import Checkpoint, build_checkpoint
from tests.worker.conftest import start_scheduler

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
# vLLM's CPU kernels want wider heads than the reference engine's tiny checkpoint.
VLLM_SIZES = dict(
    hidden_size=256,
    intermediate_size=512,
    head_dim=64,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
)
# Imports (about 20 s) and the engine's start on a busy 2-core machine.
WORKER_START_SECONDS = 240.0


def require_vllm() -> Path:
    if VLLM_PYTHON.exists():
        return VLLM_PYTHON
    reason = ".venv-vllm is missing: run scripts/setup.sh --engine vllm"
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (.ci/run makes it; under CI these tests must run)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def vllm_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    require_vllm()
    return build_checkpoint(tmp_path_factory.mktemp("vllm") / "tiny-qwen35", sizes=VLLM_SIZES)


class PlainVllm:
    """Plain vLLM's answers per conversation and turn (tests/vllm/plain.py; `options` are
    its request's: a temperature and a seed, prefix caching off), computed in a subprocess
    that runs while the caller does something else."""

    def __init__(
        self,
        model: Path,
        conversations: list[list[list[int]]],
        max_tokens: int,
        **options: float | bool,
    ):
        request = {
            "model": str(model),
            "max_tokens": max_tokens,
            "conversations": conversations,
            **options,
        }
        self._popen = subprocess.Popen(
            [str(require_vllm()), "-m", "tests.vllm.plain"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=clean_env(),
        )
        self._request = json.dumps(request)

    def answers(self) -> list:
        try:
            out, err = self._popen.communicate(self._request, timeout=600)
        except subprocess.TimeoutExpired:
            self._popen.kill()
            raise
        assert self._popen.returncode == 0, err[-3000:]
        # vLLM logs to stdout too: the answers are the last line.
        return json.loads(out.strip().splitlines()[-1])["answers"]


def run_in_vllm(module: str, *args: str, timeout: float = 600) -> str:
    """`python -m module args` in .venv-vllm; its stdout (it must exit 0)."""
    done = subprocess.run(
        [str(require_vllm()), "-m", module, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=clean_env(),
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def vllm_worker_argv(target: str, model: Path, worker_id: str, *flags: str) -> list[str]:
    return worker_argv(target, worker_id, model, "--engine", "vllm", *flags, python=require_vllm())


class VllmStack:
    """An in-process scheduler, vLLM worker processes, and (on request) a gateway."""

    def __init__(self, logs: Path, **config) -> None:
        self.logs = logs
        self.server = start_scheduler(**config)
        self.target = f"{LOOPBACK}:{self.server.port}"
        self.channel = grpc.insecure_channel(self.target)
        self.stub = pb_grpc.SchedulerStub(self.channel)
        self.workers: dict[str, Process] = {}
        self.gateway: Process | None = None

    @property
    def registry(self):
        return self.server.registry

    def add_worker(self, worker_id: str, model: Path, *flags: str) -> None:
        argv = vllm_worker_argv(self.target, model, worker_id, *flags)
        self.workers[worker_id] = Process(worker_id, argv, self.logs / f"{worker_id}.log")

    def wait_registered(self, count: int) -> None:
        def exited() -> str | None:
            return next(
                (
                    f"{w.name} exited: {w.log_text()[-3000:]}"
                    for w in self.workers.values()
                    if not w.alive()
                ),
                None,
            )

        wait_until(
            lambda: len(self.stub.GetStatus(pb.GetStatusRequest()).workers) >= count,
            f"{count} vLLM workers to register",
            WORKER_START_SECONDS,
            every_seconds=0.5,
            gone=exited,
        )

    def start_gateway(self, model: Path) -> str:
        self.gateway = spawn(
            "gateway", gateway_argv(self.target, model), self.logs, GATEWAY_LISTENING
        )
        return f"http://{LOOPBACK}:{self.gateway.ports[0]}"

    def worker_logs(self) -> str:
        return "".join(w.log_text() for w in self.workers.values())

    def close(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        for worker in self.workers.values():
            worker.stop(30)
        self.channel.close()
        self.server.stop(0)


@pytest.fixture(scope="module")
def vllm_logs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("vllm-logs")
