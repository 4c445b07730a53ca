"""A worker whose running list did not change says so (`running_unchanged_since`) and takes
"decode all of it" (`decode_all_running`) for an answer, when its scheduler says at
registration it takes both (`accepts_running_unchanged`): the same decisions as the full
form on the same workload, no token lost or added twice when reports are sent twice or the
scheduler forgets the list, and an old-form worker answered as before."""

from __future__ import annotations

import random
import threading

import pytest

from lattice.scheduler.v1 import scheduler_pb2 as pb
from service.core import Scheduler, SchedulerConfig, SubmitParams
from service.sim.client import InProcessClient
from tests.unit.factories import FakeClock
from worker_client.client import WorkerResources
from worker_client.loop import WorkerLoop
from worker_client.testing import ScriptedEngine, reference_output

NUM_SEQUENCES = 40
MAX_REPORTS = 5000  # far more than the workload takes


class _Recording(InProcessClient):
    """The in-process scheduler (with the server's RunningLists), which says it takes the
    unchanged form only when `accepts`; records each iteration's decision as the worker
    runs it. `faults` (a seeded Random): some answers are lost and their report sent again
    (the scheduler applies it twice), and sometimes the scheduler forgets the worker's list
    (as after a restart), so that it must ask for it."""

    def __init__(
        self,
        scheduler: Scheduler,
        stop: threading.Event,
        accepts: bool,
        faults: random.Random | None = None,
    ) -> None:
        super().__init__(scheduler)
        self.decisions: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        self.requests: list[pb.SelectBatchRequest] = []
        self.num_running_needed = 0
        self._stop, self._accepts, self._faults = stop, accepts, faults

    def register(self, resources: WorkerResources) -> pb.RegisterWorkerResponse:
        response = super().register(resources)
        response.accepts_running_unchanged = self._accepts
        return response

    def select(self, request: pb.SelectBatchRequest) -> pb.SchedulerDecision:
        if self._faults is not None and self._faults.random() < 0.1:
            self._running_lists.forget(request.worker_id)
        if self._faults is not None and self._faults.random() < 0.2:
            super().select(request)  # its answer is lost: the same report goes again
        self.requests.append(request)
        running = self._running_lists.running(request)  # what the report stands for
        answer = super().select(request)
        if answer.running_needed:
            self.num_running_needed += 1
        else:
            decode = running if answer.decode_all_running else tuple(answer.decode)
            self.decisions.append((tuple(c.seq_id for c in answer.prefill), decode))
        status = self.scheduler.status()
        done = status.queue_depth == 0 and status.num_assigned == 0
        if done or len(self.requests) > MAX_REPORTS:
            self._stop.set()  # done, or stuck: the outputs then say what is missing
        return answer


def _workload(seed: int) -> list[SubmitParams]:
    rng = random.Random(seed)
    return [
        SubmitParams(
            prompt_token_ids=tuple(rng.randrange(1, 999) for _ in range(rng.randrange(4, 60))),
            max_new_tokens=rng.randrange(1, 40),
            request_id=f"r{i}",
        )
        for i in range(NUM_SEQUENCES)
    ]


def _run(seed: int, accepts: bool, overlap: bool, faults: random.Random | None = None):
    scheduler = Scheduler(SchedulerConfig(policy="budget", max_batch_size=16), clock=FakeClock())
    workload = _workload(seed)
    seq_ids = [scheduler.submit(p).seq_id for p in workload]
    engine, stop = ScriptedEngine(total_kv_pages=4096, total_gdn_slots=16), threading.Event()
    client = _Recording(scheduler, stop, accepts, faults)
    resources = WorkerResources(
        "w0", engine.total_kv_pages, engine.page_size, engine.total_gdn_slots, max_batch_size=16
    )
    WorkerLoop(engine, client, resources, idle_sleep_seconds=0.001, overlap=overlap).run(stop)
    outputs = [list(scheduler.read_output(s, 0).token_ids) for s in seq_ids]
    expected = [reference_output(p.prompt_token_ids, p.max_new_tokens) for p in workload]
    return client, outputs, expected


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_unchanged_form_gets_the_decisions_of_the_full_form(seed, overlap):
    full, full_outputs, expected = _run(seed, accepts=False, overlap=overlap)
    short, short_outputs, _ = _run(seed, accepts=True, overlap=overlap)
    assert short.decisions == full.decisions
    assert short_outputs == full_outputs == expected
    # The form was used: most steady reports left their running list out, and no full
    # report or old-form worker got an answer without a decode list.
    unchanged = [r for r in short.requests if r.running_unchanged_since]
    assert len(unchanged) > len(short.requests) // 3
    assert not any(r.running_unchanged_since or r.accepts_decode_all_running for r in full.requests)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", [4, 5, 6, 7])
def test_reports_sent_twice_and_a_forgotten_list_lose_and_repeat_no_token(seed, overlap):
    client, outputs, expected = _run(
        seed, accepts=True, overlap=overlap, faults=random.Random(seed)
    )
    assert outputs == expected
    assert client.num_running_needed > 0  # the forgotten list was asked for, and sent


def _one_queued_sequence() -> tuple[Scheduler, int, InProcessClient]:
    """A scheduler with one queued sequence and worker w0 registered through a client."""
    scheduler = Scheduler(SchedulerConfig(policy="budget", max_batch_size=8), clock=FakeClock())
    seq_id = scheduler.submit(SubmitParams(prompt_token_ids=(1, 2, 3), max_new_tokens=9)).seq_id
    client = InProcessClient(scheduler)
    client.register(WorkerResources("w0", 4096, 16, 8, max_batch_size=8))
    return scheduler, seq_id, client


def _steady(client: InProcessClient, running, **fields) -> pb.SchedulerDecision:
    return client.select(
        pb.SelectBatchRequest(
            worker_id="w0",
            running=running,
            kv_free_pages=4000,
            gdn_free_slots=8,
            accepts_decode_all_running=True,
            **fields,
        )
    )


def test_a_report_naming_a_list_not_held_applies_nothing_and_asks_for_it():
    scheduler, seq_id, client = _one_queued_sequence()
    admitted = _steady(client, ())
    assert [c.seq_id for c in admitted.prefill] == [seq_id]
    full = _steady(client, (seq_id,), token_seq_ids=[seq_id], token_ids=[7], token_offsets=[0])
    assert full.decode_all_running and not full.decode
    named = dict(token_seq_ids=[seq_id], token_ids=[8], token_offsets=[1])
    stale = _steady(client, (), running_unchanged_since=full.iteration + 5, **named)
    assert stale.running_needed and not (stale.decode or stale.decode_all_running)
    assert list(scheduler.read_output(seq_id, 0).token_ids) == [7]  # nothing applied
    steady = _steady(client, (), running_unchanged_since=full.iteration, **named)
    assert steady.decode_all_running and steady.iteration == full.iteration + 1
    again = _steady(client, (), running_unchanged_since=full.iteration, **named)  # a retry
    assert again.decode_all_running
    assert list(scheduler.read_output(seq_id, 0).token_ids) == [7, 8]


def test_an_old_form_worker_gets_its_decode_list_in_full():
    scheduler, seq_id, client = _one_queued_sequence()
    request = pb.SelectBatchRequest(worker_id="w0", kv_free_pages=4000, gdn_free_slots=8)
    client.select(request)
    request.running.append(seq_id)
    answer = client.select(request)
    assert list(answer.decode) == [seq_id] and not answer.decode_all_running
