"""A replica takes answer_due_us (docs/contract.md, "Answers due later") where its due wait
is longer than its plain one, and says so at registration."""

from __future__ import annotations

import pytest

from worker_client import convert
from worker_client.client import WorkerResources


@pytest.mark.parametrize("due_wait_ms, takes", [(10.0, True), (5.0, False), (0.0, False)])
def test_a_replica_says_whether_it_holds_answers_until_they_are_due(
    start_replicas, due_wait_ms, takes
):
    (replica,) = start_replicas(1, replica_commit_due_wait_ms=due_wait_ms)
    request = convert.register_request(WorkerResources("w", 4096, 16, 8))
    assert replica.stub.RegisterWorker(request, timeout=10).accepts_answer_due is takes
