"""The TTFT target: earliest deadline first inside a priority band, and shedding of
sheddable (negative priority) requests that could not start in time."""

from __future__ import annotations

import pytest

from service.core import Scheduler, SchedulerConfig
from service.core.decide.orders import ArrivalOrder, DeadlineOrder, queue_order
from service.core.errors import DeadlineUnreachable, QueueFull
from service.core.learn.step_model import StepShape, chunk_attention
from tests.unit.factories import FakeClock, register, report, submit


def _scheduler(clock: FakeClock | None = None, **overrides) -> Scheduler:
    overrides.setdefault("policy", "budget")
    overrides.setdefault("ttft_target_ms", 2000.0)
    return Scheduler(SchedulerConfig(**overrides), clock=clock or FakeClock())


def _admitted(decision) -> list[int]:
    return [c.seq_id for c in decision.prefill if c.spec is not None]


def test_a_ttft_target_gives_budget_the_deadline_order_and_fifo_keeps_arrival():
    assert queue_order(SchedulerConfig(policy="budget", ttft_target_ms=500.0)) == DeadlineOrder(
        30.0
    )
    assert queue_order(SchedulerConfig(policy="budget")) == ArrivalOrder()


def test_inside_a_band_the_earliest_deadline_goes_first_and_a_late_one_keeps_its_place():
    clock = FakeClock()
    sched = _scheduler(clock, max_batch_size=1, aging_seconds=1000.0)
    register(sched)
    late = submit(sched, priority=1)
    clock.advance_ms(5000)  # `late` is past its deadline now: it stays, first of its band
    urgent = submit(sched, priority=0)
    second = submit(sched, priority=1)
    order = []
    for _ in range(3):
        decision = sched.select_batch(report("w0"))
        order += _admitted(decision)
        for seq_id in _admitted(decision):
            sched.cancel(seq_id)
    assert order == [urgent, late, second]


def test_a_requeued_sequence_keeps_its_deadline():
    clock = FakeClock()
    sched = _scheduler(clock, max_batch_size=1)
    register(sched)
    first = submit(sched)
    clock.advance_ms(10)
    later = submit(sched)
    assert _admitted(sched.select_batch(report("w0"))) == [first]
    # The worker preempts it: back in the queue ahead of `later` by its deadline.
    assert _admitted(sched.select_batch(report("w0", preempted=[first]))) == [first]
    assert later  # still queued


def _teach(sched: Scheduler, worker_id: str, ms_per_token: float) -> None:
    model = sched._step_times.model(worker_id)
    for i in range(200):
        tokens = 64 + 31 * (i % 30)
        model.observe(
            StepShape(tokens, chunk_attention(0, tokens)), (10.0 + ms_per_token * tokens) / 1000
        )


def test_a_sheddable_request_that_cannot_start_in_time_is_refused_saying_why():
    sched = _scheduler(ttft_target_ms=1500.0, max_seq_len=8192)
    register(sched)
    _teach(sched, "w0", ms_per_token=1.0)  # about 1,000 prompt tokens a second
    for _ in range(2):  # 0 and then 1,000 tokens ahead: starts within 1.5 s
        submit(sched, prompt_len=1000, priority=-1)
    with pytest.raises(DeadlineUnreachable, match=r"shed: priority -1 .*2000 prompt tokens"):
        submit(sched, prompt_len=1000, priority=-1)
    assert issubclass(DeadlineUnreachable, QueueFull)  # RESOURCE_EXHAUSTED on the wire
    # A request of priority >= 0 is never shed: it queues, late.
    submit(sched, prompt_len=1000, priority=0)


def test_a_sheddable_request_is_taken_while_the_fleet_can_start_it_in_time():
    sched = _scheduler(ttft_target_ms=1000.0, max_seq_len=8192)
    register(sched, "w0")
    register(sched, "w1")
    for worker_id in ("w0", "w1"):
        _teach(sched, worker_id, ms_per_token=0.1)  # about 10,000 tokens a second each
    for _ in range(10):
        submit(sched, prompt_len=1000, priority=-1)


def test_without_a_worker_a_sheddable_request_is_refused_and_others_queue():
    sched = _scheduler()
    with pytest.raises(DeadlineUnreachable, match="no worker is registered"):
        submit(sched, priority=-2)
    submit(sched, priority=-2 + 2)


def _replica(**overrides):
    from service.core import ReplicaScheduler

    overrides.setdefault("policy", "budget")
    overrides.setdefault("ttft_target_ms", 1500.0)
    overrides.setdefault("max_seq_len", 8192)
    return ReplicaScheduler(SchedulerConfig(**overrides), clock=FakeClock())


def test_a_replica_sheds_a_late_sheddable_request_counting_its_share_of_the_shared_queue():
    from service.core.types import SubmitParams

    replica = _replica()
    register(replica)
    _teach(replica, "w0", ms_per_token=1.0)  # about 1,000 prompt tokens a second
    late = SubmitParams(prompt_token_ids=[1] * 1000, max_new_tokens=4, priority=-1)
    assert replica.is_sheddable(late)
    # Its own queue is empty: 1,000 unclaimed tokens ahead over 2 replicas start in time.
    replica.shed_if_late(late, shared_tokens_ahead=1000, num_replicas=2)
    # 4,000 over 2 replicas: 2,000 tokens of this replica's share, about 2 s: shed.
    with pytest.raises(DeadlineUnreachable, match=r"shed: priority -1 .*2000 prompt tokens"):
        replica.shed_if_late(late, shared_tokens_ahead=4000, num_replicas=2)
    # Its own queue counts too: 1,000 queued here plus a 1,000-token share.
    submit(replica, prompt_len=1000, priority=-1)
    with pytest.raises(DeadlineUnreachable, match="2000 prompt tokens"):
        replica.shed_if_late(late, shared_tokens_ahead=2000, num_replicas=2)
    # Priority 0 is never sheddable.
    assert not replica.is_sheddable(SubmitParams(prompt_token_ids=[1], max_new_tokens=4))


def test_a_replica_without_workers_sheds_nothing_and_without_a_target_nothing_is_sheddable():
    from service.core.types import SubmitParams

    late = SubmitParams(prompt_token_ids=[1] * 1000, max_new_tokens=4, priority=-1)
    _replica().shed_if_late(late, shared_tokens_ahead=10**9, num_replicas=1)
    assert not _replica(ttft_target_ms=0.0).is_sheddable(late)
