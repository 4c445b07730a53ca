"""The simulator: every request finishes once with its length, the same seed gives the same
figures, the routing baseline routes as it says, the WorkerLoop is the production one."""

from __future__ import annotations

import functools

import pytest

from service.core import FinishReason, SchedulerConfig
from service.core.config import POLICIES
from service.sim.metrics import JSON_KEYS, summarize
from service.sim.simulator import RunSpec, Simulation, SimulationStalled, WorkerShape
from service.sim.workload import Request
from tests.sim.factories import LinearCost
from worker_client.loop import WorkerLoop


def requests(n: int, *, gap: float = 0.05, prompt: int = 40, output: int = 12) -> list[Request]:
    return [Request(i, i * gap, prompt + 13 * (i % 5), output + 7 * (i % 3)) for i in range(n)]


def run(reqs, *, workers=2, routing="pull", kv_pages=256, gdn_slots=16, config=None):
    config = config or SchedulerConfig(chunk_size=32, policy="fifo")
    spec = RunSpec(config, WorkerShape(kv_pages, 4, gdn_slots), workers, routing)
    return Simulation(spec, LinearCost(), reqs).run()


def assert_conserved(outcome, reqs):
    for record, request in zip(outcome.records, reqs):
        assert record.num_finishes == 1, request
        assert record.finish_reason is FinishReason.MAX_LENGTH, request
        assert record.num_tokens == request.output_len, request
        assert record.request.arrival_seconds <= record.admitted_at <= record.first_token_at
        assert record.first_token_at <= record.last_token_at <= record.finished_at


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("routing", ["pull", "round-robin", "least-loaded"])
def test_every_request_finishes_once_with_its_output_length(routing, policy):
    reqs = requests(40)
    config = SchedulerConfig(chunk_size=32, policy=policy)
    assert_conserved(run(reqs, routing=routing, config=config), reqs)


@pytest.mark.parametrize("policy", POLICIES)
def test_conservation_holds_through_preemptions_when_pages_run_out(policy):
    reqs = requests(30, gap=0.001, prompt=30, output=40)
    config = SchedulerConfig(chunk_size=32, policy=policy)
    outcome = run(reqs, kv_pages=40, workers=2, config=config)
    assert outcome.engine_preemptions + outcome.scheduler_preemptions > 0
    assert_conserved(outcome, reqs)


def test_the_same_requests_give_the_same_figures():
    reqs = requests(30)
    first = summarize(run(reqs), policy="fifo", qps=20, workers=2, routing="pull")
    second = summarize(run(reqs), policy="fifo", qps=20, workers=2, routing="pull")
    assert first == second


def test_figures_hold_the_issue_keys_in_seconds_and_counts():
    reqs = requests(20)
    result = summarize(run(reqs), policy="fifo", qps=20, workers=2, routing="pull")
    assert tuple(result.to_json()) == JSON_KEYS
    assert 0 < result.ttft_p50 <= result.ttft_p90 <= result.ttft_p99 < result.e2e_p99
    assert 0 < result.tpot_p50 <= result.tpot_p99
    assert result.queue_p50 <= result.ttft_p50
    assert result.output_tokens_per_s == pytest.approx(
        sum(r.output_len for r in reqs) / result.makespan
    )


def test_a_lone_request_is_timed_by_the_cost_model():
    # prompt 8 in one chunk (10 ms + 8 rows), then 2 decodes (10 ms + 1 row each).
    outcome = run([Request(0, 1.0, 8, 3)], workers=1)
    record = outcome.records[0]
    assert record.admitted_at == pytest.approx(1.0)
    assert record.first_token_at - 1.0 == pytest.approx(0.0108)
    assert record.finished_at - record.first_token_at == pytest.approx(2 * 0.0101)


def test_round_robin_gives_each_worker_its_turn_and_pull_lets_the_free_one_take_it():
    # Two requests at once, each long enough to keep a worker busy: round-robin puts them
    # on both workers; so does pull (the idle worker takes what the busy one did not).
    reqs = [Request(0, 0.0, 8, 50), Request(1, 0.0, 8, 50)]
    for routing in ("round-robin", "pull"):
        config = SchedulerConfig(chunk_size=32, max_batch_size=1, policy="fifo")
        outcome = run(reqs, workers=2, routing=routing, config=config)
        assert outcome.records[0].first_token_at == outcome.records[1].first_token_at


def test_least_loaded_routes_to_the_worker_with_fewest_unfinished_requests():
    # Request 0 keeps worker 0 busy (max batch 1); request 1 went to worker 1 and finished
    # when request 2 arrives. Least-loaded sends 2 to the free worker 1; round-robin sends it
    # to worker 0's queue, behind request 0.
    reqs = [Request(0, 0.0, 8, 200), Request(1, 0.1, 8, 5), Request(2, 0.5, 8, 5)]
    config = SchedulerConfig(chunk_size=32, max_batch_size=1, policy="fifo")
    least = run(reqs, workers=2, routing="least-loaded", config=config).records
    assert least[1].finished_at < 0.5
    assert least[2].first_token_at - 0.5 == pytest.approx(0.0108)
    rr = run(reqs, workers=2, routing="round-robin", config=config).records
    assert rr[2].first_token_at > rr[0].finished_at


def test_a_request_that_can_never_fit_stops_the_run_with_a_reason():
    spec = RunSpec(SchedulerConfig(chunk_size=32, policy="fifo"), WorkerShape(4, 4, 4), 1)
    # 40 prompt tokens need 10 pages of 4: the engine fails it, which finishes it...
    outcome = Simulation(spec, LinearCost(), [Request(0, 0.0, 40, 2)]).run()
    assert outcome.records[0].finish_reason is FinishReason.FAILED
    # ...while a worker that never admits anything (here: always draining) leaves a run
    # stuck, which is reported rather than looping forever.
    stuck = Simulation(
        RunSpec(SchedulerConfig(chunk_size=32, policy="fifo"), WorkerShape(64, 4, 4), 2),
        LinearCost(),
        [Request(0, 0.0, 8, 2)],
    )
    for worker in stuck._workers:
        worker.loop.iterate = functools.partial(WorkerLoop.iterate, worker.loop, True)
    with pytest.raises(SimulationStalled, match="made no progress"):
        stuck.run()


def test_workers_run_the_production_worker_loop_through_the_wire_mapping(monkeypatch):
    from service.server import convert

    calls = {"iterate": 0, "worker_report": 0, "decision": 0}
    for owner, name in ((WorkerLoop, "iterate"), (convert, "worker_report"), (convert, "decision")):
        original = getattr(owner, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
    outcome = run(requests(5))
    assert calls["iterate"] == outcome.num_iterations
    assert calls["worker_report"] == calls["decision"] >= outcome.num_iterations
