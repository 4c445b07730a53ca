"""Group commit under faults: replicas whose commits wait for more saves to join
(--replica-commit-wait-ms 20, so that at almost any moment under load a commit holds
saves of several calls that have not answered yet), killed with kill -9 or cut off by a
PostgreSQL restart. As in test_replica_faults.py: every acknowledged sequence finishes
exactly once with exactly the reference tokens."""

from __future__ import annotations

import pytest

from bench.harness.fault_stack import make_jobs
from bench.harness.processes import scrape
from common.waiting import wait_until
from tests.faults.outcome import assert_nothing_lost

from .harness import ReplicaClients, ReplicaStack, wait_all_done

pytestmark = pytest.mark.slow

NUM_CLIENTS = 4
JOBS_PER_CLIENT = 15
DONE_TIMEOUT_SECONDS = 90.0
COMMIT_WAIT_MS = "20"
SAVES = ("lattice_scheduler_database_saves_committed_total", ())
COMMITS = ("lattice_scheduler_database_commits_total", ())


@pytest.fixture
def stack(tmp_path, database_url):
    made = ReplicaStack(
        tmp_path, database_url, replica_args=("--replica-commit-wait-ms", COMMIT_WAIT_MS)
    )
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
            make_jobs(JOBS_PER_CLIENT, seed=10 + i, prefix=f"grouped{i}"),
            submit_interval_seconds=0.05,
        ).start()
        for i in range(NUM_CLIENTS)
    ]
    yield started
    for c in started:
        c.close()


def _acknowledged(clients) -> int:
    return sum(c.num_acknowledged for c in clients)


def _grouped(metrics) -> bool:
    return metrics.get(SAVES, 0) > metrics.get(COMMITS, 0) > 0


def _assert_each_finished_once(stack: ReplicaStack, clients: list[ReplicaClients]) -> None:
    jobs = [job for c in clients for job in c.jobs]
    assert_nothing_lost(stack.stub, jobs)


def test_a_replica_killed_in_the_middle_of_group_commits_loses_nothing(stack, clients):
    wait_until(lambda: _acknowledged(clients) >= 20, "20 acknowledged submits", 30)
    # Its commits are groups: more saves than commits (the kill lands amid them). How
    # soon the first group forms depends on how the load fell on this replica.
    wait_until(lambda: _grouped(scrape(stack.metrics_ports[0])), "a commit of several saves", 30)
    stack.kill_replica(0)
    assert _acknowledged(clients) < NUM_CLIENTS * JOBS_PER_CLIENT  # the kill landed mid-run
    wait_all_done(clients, DONE_TIMEOUT_SECONDS)
    _assert_each_finished_once(stack, clients)


def test_a_postgresql_restart_amid_group_commits_loses_nothing(stack, clients, pg_cluster):
    wait_until(lambda: _acknowledged(clients) >= 20, "20 acknowledged submits", 30)
    pg_cluster.restart()  # fast shutdown: commits in flight roll back, connections drop
    wait_all_done(clients, DONE_TIMEOUT_SECONDS)
    _assert_each_finished_once(stack, clients)
