"""The prefix cache on the wire, worker side: registration, the CacheReport delta (a reset
after each registration), kv_cached_pages, cache_misses and cached first chunks."""

from __future__ import annotations

import threading

import grpc
import pytest

from common.block_hash import block_hashes
from lattice.scheduler.v1 import scheduler_pb2 as pb
from worker_client.client import NotRegistered, WorkerResources
from worker_client.loop import WorkerLoop

torch = pytest.importorskip("torch")

BLOCK = 8
PROMPT = list(range(2, 30))  # 28 tokens


class ScriptedClient:
    """Answers SelectBatch with `decisions` in order (a NotRegistered once where asked)."""

    def __init__(self, decisions, stop: threading.Event, forget_at: int | None = None) -> None:
        self.registrations: list[WorkerResources] = []
        self.requests: list[pb.SelectBatchRequest] = []
        self._decisions, self._stop, self._forget_at = decisions, stop, forget_at

    def register(self, resources: WorkerResources) -> pb.RegisterWorkerResponse:
        self.registrations.append(resources)
        return pb.RegisterWorkerResponse(chunk_size=512, max_batch_size=8, lease_ttl_ms=10_000)

    def select(self, request: pb.SelectBatchRequest) -> pb.SchedulerDecision:
        self.requests.append(pb.SelectBatchRequest.FromString(request.SerializeToString()))
        if len(self.requests) == self._forget_at:
            raise NotRegistered(
                "SelectBatch", grpc.StatusCode.FAILED_PRECONDITION, "unknown worker"
            )
        decision = self._decisions[min(len(self.requests), len(self._decisions)) - 1]
        if len(self.requests) >= len(self._decisions):
            self._stop.set()
        return decision

    def deregister(self, worker_id: str) -> int:
        return 0


def _engine():
    from worker_client.engine.engine import ModelEngine
    from worker_client.engine.loading import load_model

    model = load_model("tiny", device="cpu", dtype=torch.float32, seed=0)
    return ModelEngine(
        model,
        total_kv_pages=64,
        page_size=4,
        total_gdn_slots=4,
        device="cpu",
        cache_block_tokens=BLOCK,
        total_snapshot_slots=8,
    )


def _admit(seq_id: int, start: int, length: int, cached: int = 0) -> pb.PrefillChunk:
    return pb.PrefillChunk(
        seq_id=seq_id,
        chunk_start=start,
        chunk_len=length,
        cached_tokens=cached,
        spec=pb.SequenceSpec(prompt_token_ids=PROMPT, max_new_tokens=2),
    )


def test_the_worker_registers_its_cache_and_reports_resume_points_hits_and_misses():
    engine, stop = _engine(), threading.Event()
    hashes = block_hashes(PROMPT, "", BLOCK)
    decisions = [
        pb.SchedulerDecision(prefill=[_admit(1, 0, 16)]),  # ends on a block: a snapshot at 16
        pb.SchedulerDecision(prefill=[pb.PrefillChunk(seq_id=1, chunk_start=16, chunk_len=12)]),
        pb.SchedulerDecision(decode=[1]),  # seq 1 ends: its blocks stay, unused
        pb.SchedulerDecision(prefill=[_admit(2, 16, 12, cached=16)]),  # a hit
        pb.SchedulerDecision(prefill=[_admit(3, 8, 20, cached=8)]),  # no snapshot at 8: a miss
        pb.SchedulerDecision(),
    ]
    client = ScriptedClient(decisions, stop)
    WorkerLoop(
        engine, client, WorkerResources.of("w", engine), idle_sleep_seconds=0.001, overlap=False
    ).run(stop)

    assert client.registrations[0].cache_block_tokens == BLOCK
    assert client.registrations[0].total_snapshot_slots == 8
    first, after_chunk = client.requests[0], client.requests[1]
    assert first.cache.reset and list(first.cache.added) == []
    assert list(after_chunk.cache.added) == [hashes[1]] and not after_chunk.cache.reset
    assert client.requests[3].kv_cached_pages > 0  # seq 1 ended: its blocks are free cache
    assert client.requests[3].kv_free_pages == 64
    after_hit = client.requests[4]
    assert list(after_hit.cache_misses) == [] and 2 in after_hit.running
    after_miss = client.requests[5]
    assert list(after_miss.cache_misses) == [3]
    assert 3 not in after_miss.waiting and 3 not in after_miss.running


def test_a_registration_after_the_scheduler_forgot_the_worker_resends_every_resume_point():
    engine, stop = _engine(), threading.Event()
    decisions = [
        pb.SchedulerDecision(prefill=[_admit(1, 0, 16)]),
        pb.SchedulerDecision(),  # the report after the chunk: the scheduler forgot us
        pb.SchedulerDecision(),
        pb.SchedulerDecision(),
    ]
    client = ScriptedClient(decisions, stop, forget_at=2)
    WorkerLoop(
        engine, client, WorkerResources.of("w", engine), idle_sleep_seconds=0.001, overlap=False
    ).run(stop)
    assert len(client.registrations) == 2
    lost, again = client.requests[1], client.requests[2]
    assert len(lost.cache.added) == 1 and not lost.cache.reset
    assert again.cache.reset and list(again.cache.added) == list(lost.cache.added)
    assert not client.requests[3].cache.reset and not client.requests[3].cache.added
