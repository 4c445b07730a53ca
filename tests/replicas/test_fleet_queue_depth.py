"""lattice_scheduler_fleet_queue_depth on replicas: every replica reports the shared
queue's depth (from its keeper), which each one's own queue_depth cannot show: a replica
holds only what it claimed ahead for its workers."""

from __future__ import annotations

import math

from common.waiting import wait_until
from tests.server.wire import Worker, admit_until, submit_many


def test_every_replica_reports_the_shared_queue_and_it_clears_as_one_replica_admits(
    start_replicas,
):
    r0, r1 = start_replicas(2, replica_lease_ms=900)
    ids = submit_many(r0.stub, 5) + submit_many(r1.stub, 2)
    for replica in (r0, r1):
        wait_until(
            lambda replica=replica: replica.metric("fleet_queue_depth") == 7,
            "each replica to count the seven queued",
            10,
        )
        # No worker anywhere: neither replica claimed any, so its own queue is empty.
        assert replica.metric("queue_depth") == 0
    worker = Worker(r1.stub, "w")
    worker.register(max_batch_size=8)
    assert sorted(admit_until(worker, 7, 15)) == sorted(ids)
    for replica in (r0, r1):
        wait_until(
            lambda replica=replica: replica.metric("fleet_queue_depth") == 0,
            "each replica's count to clear",
            10,
        )


def test_a_replica_that_cannot_reach_the_database_reports_the_fleet_queue_as_unknown(
    start_replicas, pg_cluster
):
    (r0,) = start_replicas(1, replica_lease_ms=900)
    submit_many(r0.stub, 2)
    wait_until(lambda: r0.metric("fleet_queue_depth") == 2, "the two queued", 10)
    pg_cluster.stop()
    try:
        # Not its last reading: a replica cut off would hide the others' growth under max.
        wait_until(
            lambda: math.isnan(r0.metric("fleet_queue_depth")),
            "the gauge to say unknown while the keeper cannot read",
            10,
        )
        assert math.isnan(r0.metric("unservable_queued"))
    finally:
        pg_cluster.start()
    wait_until(lambda: r0.metric("fleet_queue_depth") == 2, "the count once it reads again", 30)
