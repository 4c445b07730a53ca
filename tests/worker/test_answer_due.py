"""An overlapped worker says when its answer is due (docs/contract.md, "Answers due
later"), against a scripted scheduler client (no server)."""

from __future__ import annotations

import threading
import time

from lattice.scheduler.v1 import scheduler_pb2 as pb
from tests.worker.scripted_client import ScriptedClient
from worker_client.client import WorkerResources
from worker_client.loop import WorkerLoop
from worker_client.testing import ScriptedEngine

STEP_SECONDS = 0.05
HELD_SECONDS = 0.03  # how long _DueClient holds an answer that is due later


class _DueClient(ScriptedClient):
    """A ScriptedClient that may hold answers until they are due (a replica), and holds
    each answer that is due later HELD_SECONDS."""

    def register(self, resources: WorkerResources) -> pb.RegisterWorkerResponse:
        settings = super().register(resources)
        settings.accepts_answer_due = True
        return settings

    def select(self, request: pb.SelectBatchRequest) -> pb.SchedulerDecision:
        if request.answer_due_us:
            time.sleep(HELD_SECONDS)
        return super().select(request)


def _requests(overlap: bool, client_type=_DueClient) -> list[pb.SelectBatchRequest]:
    return _run(overlap, client_type)[0]


def _run(overlap: bool, client_type=_DueClient) -> tuple[list[pb.SelectBatchRequest], WorkerLoop]:
    """Reports of a worker whose steps take STEP_SECONDS: a prefill, then decode steps."""
    stop = threading.Event()
    spec = pb.SequenceSpec(prompt_token_ids=[3, 1, 4], max_new_tokens=64)
    decisions = [
        pb.SchedulerDecision(
            iteration=1, prefill=[pb.PrefillChunk(seq_id=7, chunk_start=0, chunk_len=3, spec=spec)]
        )
    ]
    decisions += [pb.SchedulerDecision(iteration=n, decode=[7]) for n in range(2, 8)]
    client = client_type(decisions, stop)
    engine = ScriptedEngine(step_seconds=STEP_SECONDS)
    resources = WorkerResources(
        "w", engine.total_kv_pages, engine.page_size, engine.total_gdn_slots
    )
    loop = WorkerLoop(engine, client, resources, overlap=overlap, idle_sleep_seconds=0.001)
    loop.run(stop)
    return client.requests, loop


def test_an_overlapped_report_says_its_answer_is_due_when_the_step_should_end():
    dues = [r.answer_due_us for r in _requests(overlap=True)]
    # Nothing is due later before a decode step has been timed (the first report, the
    # prefill's and the first decode step's); then within the step less the slack.
    assert dues[:3] == [0, 0, 0]
    # (Bounded by twice the step: steps are timed, and a loaded machine stretches them.)
    assert all(0.02e6 <= due <= 2 * STEP_SECONDS * 1e6 for due in dues[3:7]), dues


def test_a_worker_that_does_not_overlap_wants_every_answer_at_once():
    assert {r.answer_due_us for r in _requests(overlap=False)} == {0}


def test_no_due_is_sent_to_a_scheduler_that_does_not_take_it():
    assert {r.answer_due_us for r in _requests(overlap=True, client_type=ScriptedClient)} == {0}


def test_answers_held_until_due_do_not_teach_the_worker_its_round_trip():
    # The late ask is timed from round trips: those of answers the scheduler may hold
    # (here 30 ms each) would push it earlier and earlier.
    requests, loop = _run(overlap=True)
    assert sum(1 for r in requests if r.answer_due_us) >= 3
    assert loop._round_trips.seconds is not None
    assert loop._round_trips.seconds < HELD_SECONDS / 2
