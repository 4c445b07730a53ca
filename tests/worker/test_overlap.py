"""WorkerLoop's overlapped iterations, the forecast they report, and decisions' `preempt`,
against scripted scheduler clients (no server)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from lattice.scheduler.v1 import scheduler_pb2 as pb
from tests.worker.scripted_client import ScriptedClient
from worker_client.client import NotRegistered, WorkerResources
from worker_client.engine.api import ChunkWork, SequenceSpec
from worker_client.forecast import Forecast, Holding
from worker_client.loop import WorkerLoop
from worker_client.testing import ScriptedEngine, reference_output

PROMPT = [3, 1, 4, 1, 5]


class WaitingEngine(ScriptedEngine):
    """A ScriptedEngine whose step n does not end before the report for step n+1 is in
    (or 5 s passed); `overlapped` says, per step, whether it was."""

    def __init__(self) -> None:
        super().__init__()
        self.num_reports = lambda: 0
        self.overlapped: list[bool] = []

    def step(self, prefill, decode):
        deadline = time.monotonic() + 5.0
        wanted = len(self.overlapped) + 2  # the report of step 0 came before it
        while self.num_reports() < wanted and time.monotonic() < deadline:
            time.sleep(0.001)
        self.overlapped.append(self.num_reports() >= wanted)
        return super().step(prefill, decode)


def _admit(seq_id: int, prompt=PROMPT, max_new_tokens: int = 4) -> pb.PrefillChunk:
    return pb.PrefillChunk(
        seq_id=seq_id,
        chunk_start=0,
        chunk_len=len(prompt),
        spec=pb.SequenceSpec(prompt_token_ids=prompt, max_new_tokens=max_new_tokens),
    )


def _loop(engine, client, overlap: bool) -> WorkerLoop:
    resources = WorkerResources(
        "w", engine.total_kv_pages, engine.page_size, engine.total_gdn_slots
    )
    return WorkerLoop(engine, client, resources, idle_sleep_seconds=0.001, overlap=overlap)


def _updates(request):
    """(seq_id, token_ids, offset) of each run of a report, in either of its token forms
    (TokenUpdate messages, or the packed arrays the worker sends now)."""
    for u in request.tokens:
        yield u.seq_id, list(u.token_ids), u.offset
    counts = request.token_counts or [1] * len(request.token_seq_ids)
    end = 0
    for i, (seq_id, count) in enumerate(zip(request.token_seq_ids, counts)):
        offset = request.token_offsets[i] if request.token_offsets else 0
        yield seq_id, list(request.token_ids[end : end + count]), offset
        end += count


def _tokens(requests, seq_id: int) -> list[int]:
    return [t for r in requests for s, ts, _ in _updates(r) if s == seq_id for t in ts]


# ===================================================================== preempt


def test_iterate_frees_a_preempted_sequence_before_stepping_and_does_not_report_it():
    engine, stop = ScriptedEngine(), threading.Event()
    decisions = [
        pb.SchedulerDecision(prefill=[_admit(7), _admit(8)]),
        pb.SchedulerDecision(decode=[8], preempt=[7]),
        pb.SchedulerDecision(decode=[8]),
    ]
    client = ScriptedClient(decisions, stop)
    loop = _loop(engine, client, overlap=False)
    free_slots = engine.gdn_free_slots()
    assert loop.iterate() is True
    assert engine.running_ids() == [7, 8]
    assert loop.iterate() is True
    assert engine.running_ids() == [8]  # 7 freed, 8 decoded
    assert engine.gdn_free_slots() == free_slots - 1
    assert loop.iterate() is True
    last = client.requests[-1]
    assert list(last.running) == [8]
    assert 7 not in last.preempted and 7 not in [f.seq_id for f in last.finished]
    assert _tokens(client.requests, 7) == reference_output(PROMPT, 1)  # from before


def test_iterate_without_work_returns_false_and_does_not_ask_for_a_long_poll():
    engine, stop = ScriptedEngine(), threading.Event()
    client = ScriptedClient([pb.SchedulerDecision()], stop)
    loop = _loop(engine, client, overlap=False)
    assert loop.iterate() is False
    assert client.requests[0].idle_wait_ms == 0


# ===================================================================== overlap


@pytest.mark.parametrize("overlap", [False, True], ids=["in-turn", "overlap"])
def test_an_idle_worker_asks_for_a_long_poll_and_a_busy_one_does_not(overlap):
    engine, stop = ScriptedEngine(), threading.Event()
    decisions = [
        pb.SchedulerDecision(),
        pb.SchedulerDecision(prefill=[_admit(1)]),
        pb.SchedulerDecision(decode=[1]),
    ]
    client = ScriptedClient(decisions, stop)
    _loop(engine, client, overlap).run(stop)
    waits = [r.idle_wait_ms for r in client.requests]
    assert waits[0] == waits[1] == 1000  # nothing held, nothing to report
    assert waits[2] == 0  # holding seq 1


def test_overlapped_loop_reports_the_next_step_while_the_engine_runs_this_one():
    engine, stop = WaitingEngine(), threading.Event()
    prompt = list(range(1, 21))  # 20 tokens: chunks of 8, 8, 4
    spec = pb.SequenceSpec(prompt_token_ids=prompt, max_new_tokens=3)
    decisions = [
        pb.SchedulerDecision(
            prefill=[pb.PrefillChunk(seq_id=5, chunk_start=0, chunk_len=8, spec=spec)]
        ),
        pb.SchedulerDecision(prefill=[pb.PrefillChunk(seq_id=5, chunk_start=8, chunk_len=8)]),
        pb.SchedulerDecision(prefill=[pb.PrefillChunk(seq_id=5, chunk_start=16, chunk_len=4)]),
        pb.SchedulerDecision(decode=[5]),
        pb.SchedulerDecision(decode=[5]),
        pb.SchedulerDecision(decode=[5]),  # 5 finished in the step before: dropped
    ]
    client = ScriptedClient(decisions, stop)
    engine.num_reports = lambda: len(client.requests)
    stats = _loop(engine, client, overlap=True).run(stop)

    assert engine.overlapped == [True] * 6  # each step ended after the next report
    # Each report foresees the step in flight: waiting until the prompt is done, then running.
    held = [(list(r.waiting), list(r.running)) for r in client.requests[:6]]
    assert held == [([], []), ([5], []), ([5], []), ([], [5]), ([], [5]), ([], [5])]
    # Outputs arrive one report late; all of them, once, and the finish after the last.
    assert _tokens(client.requests, 5) == reference_output(prompt, 3)
    finished = [(r, f.seq_id) for r, req in enumerate(client.requests) for f in req.finished]
    assert len(finished) == 1 and finished[0][1] == 5
    assert stats.generated_tokens == 3 and stats.finished == 1
    assert engine.kv_free_pages() == engine.total_kv_pages


def test_overlapped_loop_frees_preempted_and_evicted_ids_before_the_next_step():
    engine, stop = ScriptedEngine(), threading.Event()
    decisions = [
        pb.SchedulerDecision(
            prefill=[
                _admit(1, max_new_tokens=50),
                _admit(2, max_new_tokens=50),
                _admit(3, max_new_tokens=50),
            ]
        ),
        pb.SchedulerDecision(decode=[1, 2, 3]),
        pb.SchedulerDecision(decode=[2], preempt=[1], evict=[3]),
        pb.SchedulerDecision(decode=[2]),
    ]
    client = ScriptedClient(decisions, stop)
    _loop(engine, client, overlap=True).run(stop)
    later = client.requests[3:]
    assert all(1 not in r.running and 3 not in r.running for r in later[1:])
    assert not any(r.preempted for r in client.requests)
    assert _tokens(client.requests, 2) == reference_output(PROMPT, 50)[:4]


class MovingClient(ScriptedClient):
    """A ScriptedClient whose report number `fail_at` finds the scheduler gone: the client
    moved to another replica, which does not know the worker yet (NotRegistered)."""

    def __init__(self, decisions, stop: threading.Event, fail_at: int, moved: bool = True) -> None:
        super().__init__(decisions, stop)
        self.num_moves = 0
        self.failed: list[pb.SelectBatchRequest] = []
        self._fail_at = fail_at
        self._moved = moved  # False: the same scheduler forgot the worker

    def select(self, request: pb.SelectBatchRequest) -> pb.SchedulerDecision:
        if len(self.requests) == self._fail_at and not self.failed:
            self.failed.append(request)
            self.num_moves += self._moved
            raise NotRegistered(
                "SelectBatch", grpc.StatusCode.FAILED_PRECONDITION, "unknown worker_id"
            )
        return super().select(request)


def _delivered_tokens(requests, seq_id: int) -> list[int]:
    """The tokens of `seq_id` as the scheduler would store them, by offset: a gap fails."""
    stored: list[int] = []
    for request in requests:
        for update_seq_id, token_ids, offset in _updates(request):
            if update_seq_id != seq_id:
                continue
            assert offset <= len(stored), f"gap: offset {offset} after {stored}"
            stored[offset:] = token_ids
    return stored


def test_overlapped_loop_moving_replicas_mid_step_reports_that_steps_tokens_next():
    """The report sent while a step runs fails (the worker moved to a replica that adopts
    what it holds): the step's tokens are not lost, the next report carries them."""
    engine, stop = ScriptedEngine(), threading.Event()
    decisions = [pb.SchedulerDecision(prefill=[_admit(1, max_new_tokens=6)])]
    decisions += [pb.SchedulerDecision(decode=[1]) for _ in range(5)]
    client = MovingClient(decisions, stop, fail_at=2)
    stats = _loop(engine, client, overlap=True).run(stop)
    assert client.failed and stats.registrations == 2
    assert _delivered_tokens(client.requests, 1) == reference_output(PROMPT, 6)
    assert [f.seq_id for r in client.requests for f in r.finished] == [1]


def test_overlapped_loop_forgotten_mid_step_drops_what_it_holds_and_reports_none_of_it():
    """The same scheduler forgot the worker (no move): the sequence is dropped, its
    tokens are not reported to the new registration, its pages are free again."""
    engine, stop = ScriptedEngine(), threading.Event()
    decisions = [
        pb.SchedulerDecision(prefill=[_admit(1, max_new_tokens=6)]),
        pb.SchedulerDecision(decode=[1]),
    ]
    client = MovingClient(decisions, stop, fail_at=2, moved=False)
    stats = _loop(engine, client, overlap=True).run(stop)
    assert client.failed and stats.registrations == 2
    after = client.requests[2:]
    assert after and all(not list(_updates(r)) and not r.running and not r.waiting for r in after)
    assert engine.kv_free_pages() == engine.total_kv_pages


# ===================================================================== forecast


def _chunk(seq_id, start, length, prompt_len=None):
    spec = SequenceSpec(tuple(range(prompt_len)), 8) if prompt_len is not None else None
    return ChunkWork(seq_id, start, length, spec)


def test_forecast_moves_a_sequence_whose_prompt_completes_to_running_and_counts_its_pages():
    forecast = Forecast(page_size=4)
    now = Holding((), (), kv_free_pages=100, gdn_free_slots=8)
    after = forecast.after_step(now, [_chunk(1, 0, 6, prompt_len=10)], [])
    assert after == Holding((1,), (), 98, 7)  # 6 tokens: 2 pages, one slot
    after = forecast.after_step(Holding((1,), (), 98, 7), [_chunk(1, 6, 4)], [])
    assert after == Holding((), (1,), 97, 7)  # 10 tokens: a third page
    after = forecast.after_step(Holding((), (1,), 97, 7), [], [1])
    assert after == Holding((), (1,), 97, 7)  # 11 tokens: still three pages
    after = forecast.after_step(Holding((), (1,), 97, 7), [], [1, 1])
    assert after.kv_free_pages == 96  # 12, then 13 tokens: a fourth page


def test_forecast_forgets_what_the_engine_no_longer_holds_and_assumes_the_worst_unknown():
    forecast = Forecast(page_size=4)
    forecast.after_step(Holding((), (), 100, 8), [_chunk(1, 0, 4, prompt_len=4)], [])
    after = forecast.after_step(Holding((), (), 99, 8), [], [1])  # 1 finished meanwhile
    assert after == Holding((), (), 99, 8)
    # Held, but never seen admitted: a chunk of 8 may take up to 3 pages, a decode one.
    after = forecast.after_step(Holding((9,), (10,), 50, 8), [_chunk(9, 0, 8)], [10])
    assert after.kv_free_pages == 50 - 3 - 1


def test_forecast_of_a_readmission_frees_the_old_pages_and_keeps_the_slot():
    forecast = Forecast(page_size=4)
    forecast.after_step(Holding((), (), 100, 8), [_chunk(1, 0, 8, prompt_len=8)], [])
    after = forecast.after_step(Holding((), (1,), 98, 7), [_chunk(1, 0, 4, prompt_len=12)], [])
    assert after == Holding((1,), (), 99, 7)
