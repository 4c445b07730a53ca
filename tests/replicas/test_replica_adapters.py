"""Adapters on replicas: a replica claims a sequence with an adapter
only for a worker of its own that has it, hands back those its workers no longer can run,
and a sequence no live worker anywhere can serve says so (GetSequence and a metric)
instead of waiting unseen."""

from __future__ import annotations

import time

from common.waiting import wait_until
from lattice.scheduler.v1 import scheduler_pb2 as pb
from tests.server.wire import Worker, admitted, get_sequence, submit

NUM_SEQUENCES = 4


def _core(server):
    return server.running._serving.servicer._core


def _submit_lora(stub, adapter_id: str = "lora-x") -> int:
    return stub.Submit(
        pb.SubmitRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=2, adapter_id=adapter_id),
        timeout=5,
    ).seq_id


def _admit_all(worker: Worker, count: int, timeout: float, idle: Worker | None = None) -> list[int]:
    """What `worker` is admitted until it holds `count` (or `timeout`); `idle` reports
    meanwhile too (it stays registered) and must be admitted nothing."""
    got: list[int] = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        got += admitted(worker.select(running=got))
        if idle is not None:
            assert not admitted(idle.select()), "admitted to a worker without the adapter"
        time.sleep(0.05)
    return got


def test_adapter_sequences_wait_for_and_run_on_the_replica_whose_worker_has_the_adapter(
    start_replicas,
):
    r0, r1 = start_replicas(2, replica_lease_ms=900)
    plain = Worker(r0.stub, "plain")
    plain.register(max_batch_size=8)
    ids = [_submit_lora(r0.stub) for _ in range(NUM_SEQUENCES)]
    base = submit(r0.stub).seq_id  # a sequence the plain worker can run
    assert _admit_all(plain, 1, 10) == [base]
    # r0's prefetcher has run many times by now; it must not have taken the adapter's.
    time.sleep(1.0)
    assert _core(r0).num_queued() == 0 and not admitted(plain.select(running=[base]))
    info = get_sequence(r1.stub, ids[0])
    assert info.state == pb.SEQUENCE_STATE_QUEUED
    assert "lora-x" in info.error_message and "no live worker" in info.error_message
    wait_until(
        lambda: r0.metric("unservable_queued") == NUM_SEQUENCES,
        "the fleet-wide count of unservable sequences",
        10,
    )
    lora = Worker(r1.stub, "lora")
    lora.register(max_batch_size=8, adapters=("lora-x",))
    assert sorted(_admit_all(lora, NUM_SEQUENCES, 15)) == ids
    wait_until(lambda: r0.metric("unservable_queued") == 0, "the count to clear", 10)
    assert get_sequence(r0.stub, ids[0]).error_message == ""


def test_claimed_adapter_sequences_go_back_when_the_worker_with_the_adapter_leaves(start_replicas):
    r0, r1 = start_replicas(2, replica_lease_ms=900)
    lora0, plain0 = Worker(r0.stub, "lora0"), Worker(r0.stub, "plain0")
    lora0.register(max_batch_size=1, adapters=("lora-x",))
    plain0.register(max_batch_size=8)
    ids = [_submit_lora(r0.stub) for _ in range(NUM_SEQUENCES)]
    wait_until(lambda: _core(r0).num_queued() == NUM_SEQUENCES, "r0 to claim them for lora0", 10)
    lora0.deregister()  # plain0 still takes work on r0, but cannot run these
    lora1 = Worker(r1.stub, "lora1")
    lora1.register(max_batch_size=8, adapters=("lora-x",))
    assert sorted(_admit_all(lora1, NUM_SEQUENCES, 15, idle=plain0)) == ids
