"""When the worker loop asks `decide_later`, and what it makes of the answer
(docs/contract.md, "Late decisions"), against a scripted scheduler client (no server)."""

from __future__ import annotations

import threading

from lattice.scheduler.v1 import scheduler_pb2 as pb
from tests.worker.scripted_client import ScriptedClient
from worker_client.client import WorkerResources
from worker_client.loop import WorkerLoop
from worker_client.resources import WorkerRole
from worker_client.step_clock import LateAsk
from worker_client.testing import ScriptedEngine

PROMPT = [3, 1, 4, 1, 5]


class _AskLate(LateAsk):
    """Every step is worth a late ask, made as soon as the first answer is in."""

    def delay(self, clock, round_trips, num_prompt_tokens) -> float | None:
        return 0.0


class _LateClient(ScriptedClient):
    """A ScriptedClient that takes decide_later; `on_select(request)` runs first."""

    def __init__(self, decisions, stop, on_select=lambda request: None) -> None:
        super().__init__(decisions, stop)
        self._on_select = on_select

    def register(self, resources: WorkerResources) -> pb.RegisterWorkerResponse:
        settings = super().register(resources)
        settings.accepts_decide_later = True
        return settings

    def select(self, request: pb.SelectBatchRequest) -> pb.SchedulerDecision:
        self._on_select(request)
        return super().select(request)


def _run(client, stop, role=WorkerRole.BOTH, drain: threading.Event | None = None) -> None:
    engine = ScriptedEngine()
    resources = WorkerResources(
        "w", engine.total_kv_pages, engine.page_size, engine.total_gdn_slots, role=role
    )
    loop = WorkerLoop(engine, client, resources, idle_sleep_seconds=0.001, late_ask=_AskLate())
    loop.run(stop, drain)


def _admit(seq_id: int) -> pb.PrefillChunk:
    spec = pb.SequenceSpec(prompt_token_ids=PROMPT, max_new_tokens=8)
    return pb.PrefillChunk(seq_id=seq_id, chunk_start=0, chunk_len=len(PROMPT), spec=spec)


def _decisions() -> list[pb.SchedulerDecision]:
    """Step 1 prefills 7; the report sent while it runs is answered later (an empty
    decision), the late ask with step 2's decision."""
    return [
        pb.SchedulerDecision(iteration=1, prefill=[_admit(7)]),
        pb.SchedulerDecision(iteration=2),
        pb.SchedulerDecision(iteration=3, decode=[7]),
    ]


def test_the_late_ask_names_the_decision_whose_step_runs_not_the_deferred_answer():
    stop = threading.Event()
    client = _LateClient(_decisions(), stop)
    _run(client, stop)
    deferred, late = client.requests[1], client.requests[2]
    assert deferred.decide_later and not late.decide_later
    assert (deferred.applied_iteration, late.applied_iteration) == (1, 1)


def test_a_prefill_worker_never_asks_later_and_applies_an_empty_answer():
    # The scheduler decides a prefill worker's report at once: an empty answer is its
    # next step's decision, which the worker does not ask for again.
    stop = threading.Event()
    client = _LateClient(_decisions()[:2], stop)
    _run(client, stop, role=WorkerRole.PREFILL)
    assert not any(r.decide_later for r in client.requests)
    assert client.requests[2].applied_iteration == 2


def test_a_drain_asked_during_the_step_goes_with_the_late_ask():
    drain = threading.Event()

    def drain_once_deferred(request: pb.SelectBatchRequest) -> None:
        if request.decide_later:
            drain.set()

    stop = threading.Event()
    client = _LateClient(_decisions(), stop, drain_once_deferred)
    _run(client, stop, drain=drain)
    deferred, late = client.requests[1], client.requests[2]
    assert deferred.decide_later and not deferred.draining
    assert late.draining
    assert not any(r.decide_later for r in client.requests[2:])


class _SeenRoundTrips(_AskLate):
    """_AskLate that notes the round trip the loop has learned at each step."""

    def __init__(self) -> None:
        self.seen: list[float | None] = []

    def delay(self, clock, round_trips, num_prompt_tokens) -> float | None:
        self.seen.append(round_trips.seconds)
        return 0.0


def test_the_round_trip_learned_is_the_deciding_calls_not_the_deferred_ones():
    # A deferred answer is cheap (nothing decided); the late ask's margin is in round
    # trips of a real decision, which here take 50 ms: the cheap ones must not halve it.
    decide_ms = 0.05

    def slow_unless_deferred(request: pb.SelectBatchRequest) -> None:
        if not request.decide_later:
            threading.Event().wait(decide_ms)

    decisions = [
        pb.SchedulerDecision(iteration=1, prefill=[_admit(7)]),
        pb.SchedulerDecision(iteration=2),
        pb.SchedulerDecision(iteration=3, decode=[7]),
        pb.SchedulerDecision(iteration=4),
        pb.SchedulerDecision(iteration=5, decode=[7]),
        pb.SchedulerDecision(iteration=6),
        pb.SchedulerDecision(iteration=7, decode=[7]),
    ]
    stop = threading.Event()
    client = _LateClient(decisions, stop, slow_unless_deferred)
    engine = ScriptedEngine()
    resources = WorkerResources(
        "w", engine.total_kv_pages, engine.page_size, engine.total_gdn_slots
    )
    late_ask = _SeenRoundTrips()
    WorkerLoop(engine, client, resources, idle_sleep_seconds=0.001, late_ask=late_ask).run(stop)
    learned = [s for s in late_ask.seen if s is not None]
    assert learned and all(s >= 0.9 * decide_ms for s in learned), late_ask.seen
