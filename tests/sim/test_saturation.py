"""simulate --saturation: the steady completion rate of an overloaded fleet, and the
simulator's scheduler learning step times through the worker's reports."""

from __future__ import annotations

from service.core import SchedulerConfig
from service.core.learn.step_model import StepShape, chunk_attention
from service.sim import experiments
from service.sim.costs import CostSource
from service.sim.metrics import summarize
from service.sim.simulator import RunSpec, Simulation, WorkerShape
from service.sim.workload import Trace, TraceRow, make_requests
from tests.sim.factories import LinearCost


def _setup(num_workers: int, num_requests: int = 120, trace: Trace | None = None):
    trace = trace or Trace("fixed", (TraceRow(64, 20, None),))
    cost = CostSource(LinearCost(), "linear", 4096, 64)
    return experiments.Setup(
        trace,
        cost,
        WorkerShape(4096, 16, 64),
        num_workers,
        num_requests,
        "poisson",
        0,
        "pull",
        progress=False,
    )


def test_saturation_is_the_fleets_steady_rate_and_scales_with_workers():
    config = SchedulerConfig(policy="budget", max_batch_size=8)
    one = experiments.saturation(_setup(1), config)
    two = experiments.saturation(_setup(2), config)
    # 8 sequences of 20 tokens each per ~21 steps of ~11 ms: about 35 requests/s a worker.
    assert 25 < one.requests_per_second < 45
    assert 1.8 < two.requests_per_second / one.requests_per_second < 2.2
    assert [r.result.num_requests for r in one.runs] == [120, 240]


def test_the_simulated_scheduler_learns_the_cost_model_from_reported_step_times():
    # Lengths that differ, so that prefills join running decodes.
    setup = _setup(
        1, trace=Trace("mixed", tuple(TraceRow(100 + 37 * i, 5 + 7 * i, None) for i in range(8)))
    )
    config = SchedulerConfig(policy="budget", max_batch_size=8, tpot_target_ms=40.0)
    spec = RunSpec(config, setup.worker, 1)
    requests = make_requests(
        setup.trace,
        num_requests=120,
        qps=500.0,
        arrivals="poisson",
        seed=0,
        max_seq_len=config.max_seq_len,
    )
    simulation = Simulation(spec, LinearCost(), requests)
    result = summarize(simulation.run(), policy="budget", qps=500.0, workers=1, routing="pull")
    model = simulation._schedulers[0]._step_times.model("sim-0")
    for prefill, decodes in ((200, 4), (0, 8), (64, 0)):
        truth = 0.01 + 0.0001 * (prefill + decodes)  # LinearCost
        shape = StepShape(prefill, chunk_attention(0, prefill), decodes, decodes * 70)
        assert abs(model.predict(shape) - truth) / truth < 0.05
    assert result.tpot_p99 <= 0.04


def test_worker_speeds_need_one_positive_speed_per_worker():
    import pytest

    with pytest.raises(ValueError, match="--worker-speeds lists 2 speeds for 3 workers"):
        RunSpec(SchedulerConfig(), WorkerShape(64, 4, 8), 3, worker_speeds=(1.0, 0.5))
    with pytest.raises(ValueError, match="--worker-speeds must all be above 0"):
        RunSpec(SchedulerConfig(), WorkerShape(64, 4, 8), 2, worker_speeds=(1.0, 0.0))


def test_a_half_speed_worker_takes_twice_as_long():
    config = SchedulerConfig(policy="budget", max_batch_size=8)
    full = experiments.saturation(_setup(1), config)
    slow = experiments.saturation(
        experiments.Setup(**{**_setup(1).__dict__, "worker_speeds": (0.5,)}), config
    )
    assert 0.45 < slow.requests_per_second / full.requests_per_second < 0.55
