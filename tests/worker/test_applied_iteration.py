"""Each report names the decision the worker applied (`applied_iteration`): the latest one
it received, which the loop applies at once (with overlap, the one whose step runs while
it reports); never a decision whose answer was lost; 0 again after a registration."""

from __future__ import annotations

import random
import threading

import pytest

from lattice.scheduler.v1 import scheduler_pb2 as pb
from service.core import Scheduler, SchedulerConfig, SubmitParams
from service.sim.client import InProcessClient
from tests.unit.factories import FakeClock
from worker_client.client import WorkerResources
from worker_client.convert import PendingReport
from worker_client.loop import WorkerLoop
from worker_client.testing import ScriptedEngine, reference_output

MAX_REPORTS = 3000  # far more than the workload takes


class _Losing(InProcessClient):
    """Loses one answer in five (the same report then goes again); records what each
    request named and the iteration of the answer the worker got last before it."""

    def __init__(self, scheduler: Scheduler, stop: threading.Event, seed: int) -> None:
        super().__init__(scheduler)
        self.named: list[tuple[int, int]] = []  # (applied_iteration, last received)
        self._received = 0
        self._stop, self._faults = stop, random.Random(seed)

    def register(self, resources: WorkerResources) -> pb.RegisterWorkerResponse:
        self._received = 0
        return super().register(resources)

    def select(self, request: pb.SelectBatchRequest) -> pb.SchedulerDecision:
        self.named.append((request.applied_iteration, self._received))
        if self._faults.random() < 0.2:
            super().select(request)  # decided, but its answer is lost
        answer = super().select(request)
        if not answer.running_needed:
            self._received = answer.iteration
        status = self.scheduler.status()
        if (status.queue_depth == 0 and status.num_assigned == 0) or len(self.named) > MAX_REPORTS:
            self._stop.set()
        return answer


@pytest.mark.parametrize("overlap", [False, True])
def test_each_report_names_the_last_decision_received_and_lost_answers_never(overlap):
    scheduler = Scheduler(SchedulerConfig(policy="budget", max_batch_size=8), clock=FakeClock())
    rng = random.Random(3)
    workload = [
        SubmitParams(
            prompt_token_ids=tuple(rng.randrange(1, 999) for _ in range(rng.randrange(4, 40))),
            max_new_tokens=rng.randrange(1, 20),
        )
        for _ in range(12)
    ]
    seq_ids = [scheduler.submit(p).seq_id for p in workload]
    engine, stop = ScriptedEngine(total_kv_pages=4096, total_gdn_slots=8), threading.Event()
    client = _Losing(scheduler, stop, seed=5)
    resources = WorkerResources("w0", 4096, engine.page_size, 8, max_batch_size=8)
    WorkerLoop(engine, client, resources, idle_sleep_seconds=0.001, overlap=overlap).run(stop)
    assert [list(scheduler.read_output(s, 0).token_ids) for s in seq_ids] == [
        reference_output(p.prompt_token_ids, p.max_new_tokens) for p in workload
    ]
    assert client.named[0] == (0, 0)
    assert all(named == received for named, received in client.named)
    assert len({named for named, _ in client.named}) > 5  # it moved on with the decisions


def test_a_registration_starts_the_named_iteration_over():
    pending = PendingReport()
    pending.delivered(7)
    assert (
        pending.request(
            "w0", waiting=(), running=(), kv_free_pages=1, gdn_free_slots=1, draining=False
        ).applied_iteration
        == 7
    )
    pending.registered()
    assert (
        pending.request(
            "w0", waiting=(), running=(), kv_free_pages=1, gdn_free_slots=1, draining=False
        ).applied_iteration
        == 0
    )
