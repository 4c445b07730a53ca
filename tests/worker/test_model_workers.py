"""The whole system with the real engine: a scheduler, two `lattice-worker` processes running
the tiny Qwen3.5-architecture model, and 16 concurrent Generate streams.

Greedy outputs must equal sequence-by-sequence generation (engine.reference, itself pinned
to transformers by tests/engine), also when small page pools force preemptions and when a
worker is killed mid-run; afterwards every page and slot of the surviving workers is free
again. The workers run as `lattice-worker` does by default: over a WorkerSession, with
overlapped iterations (the engine steps while the next report is answered).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading

import grpc
import pytest
from prometheus_client import CollectorRegistry

from common.waiting import wait_until
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from service.core import SchedulerConfig
from service.server.app import start
from service.settings import ServeSettings
from tests.worker.conftest import generate

torch = pytest.importorskip("torch")
from worker_client.engine.loading import load_model  # noqa: E402
from worker_client.engine.reference import generate_reference  # noqa: E402

# Two worker processes with the real model: minutes on a loaded machine.
pytestmark = pytest.mark.slow

CHUNK_SIZE = 32
MAX_NEW_TOKENS = 10


@pytest.fixture(scope="module")
def reference_model():
    return load_model("tiny", device="cpu")


def random_prompts(count: int, seed: int, max_len: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Token ids from 2 up: id 1 is the tiny model's EOS.
    lengths = [
        rng.randint(3, CHUNK_SIZE - 1) if i % 2 else rng.randint(CHUNK_SIZE + 1, max_len)
        for i in range(count)
    ]
    return [[rng.randrange(2, 500) for _ in range(n)] for n in lengths]


class Stack:
    """An in-process scheduler and worker processes on loopback."""

    def __init__(self, lease_ttl_ms: int = 10_000, policy: str = "budget") -> None:
        self.registry = CollectorRegistry()
        config = SchedulerConfig(
            chunk_size=CHUNK_SIZE,
            lease_ttl_ms=lease_ttl_ms,
            prefill_reserve_pages=2,
            policy=policy,
            max_num_batched_tokens=64,
            min_prefill_chunk=8,
        )
        self.server = start(
            ServeSettings(host="127.0.0.1", port=0, metrics_port=0, scheduler=config), self.registry
        )
        self.target = f"127.0.0.1:{self.server.port}"
        self.channel = grpc.insecure_channel(self.target)
        self.stub = pb_grpc.SchedulerStub(self.channel)
        self.workers: dict[str, subprocess.Popen] = {}

    def add_worker(
        self,
        worker_id: str,
        kv_pages: int,
        page_size: int = 4,
        gdn_slots: int = 8,
        model: str = "tiny",
    ) -> None:
        self.workers[worker_id] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "worker_client",
                "--scheduler",
                self.target,
                "--worker-id",
                worker_id,
                "--model",
                model,
                "--device",
                "cpu",
                "--kv-pages",
                str(kv_pages),
                "--page-size",
                str(page_size),
                "--gdn-slots",
                str(gdn_slots),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )

    def wait_registered(self, count: int, timeout: float = 90.0) -> None:
        def exited() -> str | None:
            return next(
                (
                    f"{worker_id} exited: {proc.stdout.read()}"
                    for worker_id, proc in self.workers.items()
                    if proc.poll() is not None
                ),
                None,
            )

        wait_until(
            lambda: len(self.stub.GetStatus(pb.GetStatusRequest()).workers) >= count,
            f"{count} workers to register",
            timeout,
            every_seconds=0.2,
            gone=exited,
        )

    def generate_all(self, prompts) -> dict[int, tuple[list[int], int]]:
        results: dict[int, tuple[list[int], int]] = {}

        def one(i: int) -> None:
            _, tokens, events = generate(self.stub, prompts[i], MAX_NEW_TOKENS, timeout=120)
            results[i] = (tokens, events[-1].finish_reason)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
        return results

    def worker_status(self) -> dict[str, pb.WorkerStatus]:
        return {w.worker_id: w for w in self.stub.GetStatus(pb.GetStatusRequest()).workers}

    def close(self) -> None:
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.workers.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.channel.close()
        self.server.stop(0)


def _expected(model, prompt) -> tuple[list[int], int]:
    ref = generate_reference(model, prompt, MAX_NEW_TOKENS)
    reason = {
        "eos": pb.FINISH_REASON_EOS,
        "max_length": pb.FINISH_REASON_MAX_LENGTH,
        "stop": pb.FINISH_REASON_STOP,
    }[ref.reason.value]
    return list(ref.token_ids), reason


def assert_all_free(stack: Stack, worker_ids) -> None:
    wait_until(
        stack.worker_status,
        "every page and slot to be free",
        10,
        every_seconds=0.1,
        done=lambda status: all(
            status[w].kv_free_pages == status[w].total_kv_pages
            and status[w].gdn_free_slots == status[w].total_gdn_slots
            for w in worker_ids
        ),
    )


def _sample(registry, name, **labels) -> float:
    return registry.get_sample_value(name, labels or None) or 0.0


def test_sixteen_streams_on_two_model_workers_equal_sequential_generation(reference_model):
    stack = Stack()
    try:
        stack.add_worker("model-1", kv_pages=512)
        stack.add_worker("model-2", kv_pages=512)
        stack.wait_registered(2)
        prompts = random_prompts(16, seed=11, max_len=90)
        results = stack.generate_all(prompts)
        for i, prompt in enumerate(prompts):
            assert results[i] == _expected(reference_model, prompt), f"stream {i}"
        served = {w: s.iteration for w, s in stack.worker_status().items()}
        assert all(n > 1 for n in served.values()), served
        assert_all_free(stack, ["model-1", "model-2"])
    finally:
        stack.close()


@pytest.mark.parametrize("policy", ["fifo", "budget", "fair"])
def test_small_page_pools_preempt_and_resumed_outputs_are_unchanged(reference_model, policy):
    stack = Stack(policy=policy)
    try:
        # 24 pages of 4 tokens (96 tokens) per worker for up to 8 sequences of up to 70.
        stack.add_worker("tight-1", kv_pages=24)
        stack.add_worker("tight-2", kv_pages=24)
        stack.wait_registered(2)
        prompts = random_prompts(16, seed=12, max_len=60)
        results = stack.generate_all(prompts)
        preemptions = _sample(
            stack.registry, "lattice_scheduler_requeues_total", reason="preempted"
        )
        assert preemptions > 0, "the pools were meant to be too small"
        if policy != "fifo":  # the budget policies see it coming and choose the victims
            assert (
                _sample(stack.registry, "lattice_scheduler_preemptions_total", reason="kv_growth")
                > 0
            )
        for i, prompt in enumerate(prompts):
            assert results[i] == _expected(reference_model, prompt), f"stream {i}"
        assert_all_free(stack, ["tight-1", "tight-2"])
    finally:
        stack.close()


def test_a_worker_killed_mid_run_loses_nothing(reference_model):
    stack = Stack(lease_ttl_ms=1000)
    try:
        stack.add_worker("doomed", kv_pages=512)
        stack.wait_registered(1)
        stack.add_worker("survivor", kv_pages=512)
        stack.wait_registered(2)
        prompts = random_prompts(16, seed=13, max_len=90)
        killer = threading.Thread(target=_kill_when_busy, args=(stack, "doomed"))
        killer.start()
        results = stack.generate_all(prompts)
        killer.join(30)
        assert stack.workers["doomed"].returncode == -signal.SIGKILL
        for i, prompt in enumerate(prompts):
            assert results[i] == _expected(reference_model, prompt), f"stream {i}"
        assert (
            _sample(stack.registry, "lattice_scheduler_requeues_total", reason="lease_expired") > 0
        )
        assert_all_free(stack, ["survivor"])
    finally:
        stack.close()


def _kill_when_busy(stack: Stack, worker_id: str) -> None:
    wait_until(
        lambda: stack.worker_status().get(worker_id),
        f"{worker_id} to hold two",
        60,
        done=lambda status: status is not None and status.num_assigned >= 2,
        every_seconds=0.005,
    )
    stack.workers[worker_id].send_signal(signal.SIGKILL)
    stack.workers[worker_id].wait(10)
