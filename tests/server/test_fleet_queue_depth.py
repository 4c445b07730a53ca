"""lattice_scheduler_fleet_queue_depth on one scheduler: its queue, as of the latest lease
sweep (on replicas, the shared queue: tests/replicas/test_fleet_queue_depth.py)."""

from __future__ import annotations

from common.waiting import wait_until
from tests.server.wire import admit_until, submit_many


def test_the_fleet_queue_depth_counts_the_queue_and_clears_as_a_worker_admits(server, make_worker):
    ids = submit_many(server.stub, 3)
    wait_until(lambda: server.metric("fleet_queue_depth") == 3, "three queued", 10)
    worker = make_worker("w")
    worker.register(max_batch_size=8)
    assert sorted(admit_until(worker, 3, 10)) == sorted(ids)
    wait_until(lambda: server.metric("fleet_queue_depth") == 0, "the gauge to clear", 10)
