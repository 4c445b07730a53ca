"""Replica processes under load, killed or cut off from the database on purpose.

Two replicas on one database, two scripted workers each (--step-ms 10), four clients
submitting with unique request_ids over a round_robin channel and collecting every
acknowledged sequence by re-attaching Generate streams. The fault stack's `check` asks
of each: known, FINISHED once with the reference finish reason, exactly the reference
tokens (none missing, none twice), one seq_id for its request_id.
"""

from __future__ import annotations

import pytest

from bench.harness.fault_stack import make_jobs
from common.waiting import wait_until
from tests.faults.outcome import assert_nothing_lost

from .harness import ReplicaClients, ReplicaStack, wait_all_done

pytestmark = pytest.mark.slow

NUM_CLIENTS = 4
JOBS_PER_CLIENT = 15
DONE_TIMEOUT_SECONDS = 90.0


@pytest.fixture
def stack(tmp_path, database_url):
    made = ReplicaStack(tmp_path, database_url)
    try:
        yield made.start()
    finally:
        made.close()
        print(made.log_tails())


@pytest.fixture
def clients(stack):
    started = [
        ReplicaClients(
            stack.targets,
            make_jobs(JOBS_PER_CLIENT, seed=i, prefix=f"client{i}"),
            submit_interval_seconds=0.05,
        ).start()
        for i in range(NUM_CLIENTS)
    ]
    yield started
    for c in started:
        c.close()


def _assert_all_good(stack: ReplicaStack, clients: list[ReplicaClients]) -> None:
    jobs = [job for c in clients for job in c.jobs]
    assert_nothing_lost(stack.stub, jobs)


def _acknowledged(clients) -> int:
    return sum(c.num_acknowledged for c in clients)


def test_a_replica_killed_under_load_loses_nothing_and_each_sequence_finishes_once(stack, clients):
    wait_until(lambda: _acknowledged(clients) >= 20, "20 acknowledged submits", 30)
    stack.kill_replica(0)
    assert _acknowledged(clients) < NUM_CLIENTS * JOBS_PER_CLIENT  # the kill landed mid-run
    wait_all_done(clients, DONE_TIMEOUT_SECONDS)
    _assert_all_good(stack, clients)


def test_a_postgresql_restart_under_load_loses_nothing(stack, clients, pg_cluster):
    wait_until(lambda: _acknowledged(clients) >= 20, "20 acknowledged submits", 30)
    pg_cluster.restart()  # fast shutdown: open transactions roll back, connections drop
    wait_all_done(clients, DONE_TIMEOUT_SECONDS)
    _assert_all_good(stack, clients)
