"""WorkerLoop against a scripted scheduler client: what it reads from the engine, and when."""

from __future__ import annotations

import threading

from lattice.scheduler.v1 import scheduler_pb2 as pb
from worker_client.client import WorkerResources
from worker_client.loop import WorkerLoop
from worker_client.testing import ScriptedEngine


class CountingEngine(ScriptedEngine):
    """A ScriptedEngine that counts how often the loop asks for its held ids."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting_calls = 0
        self.running_calls = 0

    def waiting_ids(self) -> list[int]:
        self.waiting_calls += 1
        return super().waiting_ids()

    def running_ids(self) -> list[int]:
        self.running_calls += 1
        return super().running_ids()


class ScriptedClient:
    """Answers SelectBatch with `decisions` in order, then stops the loop."""

    def __init__(self, decisions: list[pb.SchedulerDecision], stop: threading.Event) -> None:
        self.requests: list[pb.SelectBatchRequest] = []
        self._decisions = decisions
        self._stop = stop

    def register(self, resources: WorkerResources) -> pb.RegisterWorkerResponse:
        return pb.RegisterWorkerResponse(chunk_size=512, max_batch_size=8, lease_ttl_ms=10_000)

    def select(self, request: pb.SelectBatchRequest) -> pb.SchedulerDecision:
        self.requests.append(request)
        decision = self._decisions[len(self.requests) - 1]
        if len(self.requests) == len(self._decisions):
            self._stop.set()
        return decision

    def deregister(self, worker_id: str) -> int:
        return 0


def test_each_iteration_reads_the_engines_held_ids_once_and_reports_them():
    prompt = [3, 1, 4, 1]
    admit = pb.PrefillChunk(
        seq_id=7,
        chunk_start=0,
        chunk_len=len(prompt),
        spec=pb.SequenceSpec(prompt_token_ids=prompt, max_new_tokens=5),
    )
    decisions = [
        pb.SchedulerDecision(prefill=[admit]),
        pb.SchedulerDecision(decode=[7]),
        pb.SchedulerDecision(),
    ]
    engine, stop = CountingEngine(), threading.Event()
    client = ScriptedClient(decisions, stop)
    resources = WorkerResources(
        "w", engine.total_kv_pages, engine.page_size, engine.total_gdn_slots
    )

    stats = WorkerLoop(engine, client, resources, idle_sleep_seconds=0.001, overlap=False).run(stop)

    assert stats.iterations == len(decisions)
    # One read of each per iteration; leaving with nothing pending reads nothing.
    assert engine.waiting_calls == engine.running_calls == len(decisions)
    # What was read is what was reported: nothing, then seq 7 prefilled and decoding.
    assert [list(r.running) for r in client.requests] == [[], [7], [7]]
    assert [list(r.waiting) for r in client.requests] == [[], [], []]
