"""A real stack on loopback: scheduler, one CPU worker and the gateway, each its own
process, serving a tiny transformers-saved Qwen3.5 with a real BPE tokenizer."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from common.processes import CPU_ONE_THREAD, LOOPBACK, Process
from common.stacks import gateway_stack
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc

from .checkpoint import Checkpoint, build_checkpoint

# How long a keyed sequence outlives its last client in these tests: long enough for a
# retry on a loaded machine, short enough to watch it lapse.
REATTACH_GRACE_SECONDS = 5.0


@dataclass
class Stack:
    checkpoint: Checkpoint
    scheduler: Process
    gateway: Process
    channel: grpc.Channel
    model_name: str

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.gateway.ports[0]}"

    @property
    def scheduler_metrics_url(self) -> str:
        return f"http://{LOOPBACK}:{self.scheduler.ports[1]}/metrics"

    @property
    def stub(self) -> pb_grpc.SchedulerStub:
        return pb_grpc.SchedulerStub(self.channel)

    def client(self, **kwargs):
        """An official `openai` client aimed at the gateway (no retries unless asked)."""
        openai = pytest.importorskip("openai")
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 60.0)
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", **kwargs)

    def sequence(self, seq_id: int) -> pb.SequenceInfo:
        return self.stub.GetSequence(pb.GetSequenceRequest(seq_id=seq_id), timeout=10)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return build_checkpoint(tmp_path_factory.mktemp("gateway") / "tiny-qwen35-chat")


@pytest.fixture(scope="session")
def stack(checkpoint: Checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with gateway_stack(
        tmp_path_factory.mktemp("gateway-logs"),
        checkpoint.path,
        workers=[("worker", CPU_ONE_THREAD)],
        gateway_flags=("--reattach-grace-seconds", str(REATTACH_GRACE_SECONDS)),
        what="the worker to register",
    ) as started:
        yield Stack(
            checkpoint, started.scheduler, started.gateway, started.channel, checkpoint.path.name
        )


@pytest.fixture(scope="session")
def idle_stack(checkpoint: Checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A scheduler with no worker and room for one queued sequence, and its gateway."""
    with gateway_stack(
        tmp_path_factory.mktemp("gateway-idle-logs"),
        checkpoint.path,
        scheduler_flags=("--max-queue", "1"),
        gateway_flags=("--served-model-name", "tiny"),
    ) as started:
        yield Stack(checkpoint, started.scheduler, started.gateway, started.channel, "tiny")
