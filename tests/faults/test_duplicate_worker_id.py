"""Two worker processes started with the same worker_id (the outside probe's scenario).

Before incarnations, both acted under the one id: each one's report made the other's
sequences look lost (~100 lost-requeues per 100 sequences), and in 2 of 8 runs a sequence
finished with wrong output. Now the later registration supersedes the earlier one, whose
next call is refused; the earlier process exits (code 3) with one line naming the
conflict instead of registering again and fighting.
"""

from __future__ import annotations

import pytest

from bench.harness.fault_stack import check, make_jobs
from common.waiting import wait_until

pytestmark = pytest.mark.slow

NUM_SEQUENCES = 100
EXIT_SUPERSEDED = 3


def _requeues(stack, reason: str) -> float:
    return stack.metrics().get(("lattice_scheduler_requeues_total", (("reason", reason),)), 0.0)


def test_a_second_process_with_the_same_worker_id_supersedes_the_first_without_a_fight(
    make_stack, make_clients
):
    stack = make_stack(num_workers=1, worker_flags=("--max-batch-size", "8"))
    first = stack.workers["w1"]
    jobs = make_jobs(NUM_SEQUENCES, seed=10)
    clients = make_clients(stack, jobs, submit_interval_seconds=0.005)
    clients.wait_acknowledged(20, timeout=20)
    stack.start_worker("w1", beside_the_running_one=True)

    wait_until(lambda: not first.alive(), "the superseded worker to exit", 30)
    clients.wait_done(60)

    assert first.popen.returncode == EXIT_SUPERSEDED, first.log_text()
    log = first.log_text()
    conflict = [line for line in log.splitlines() if line.startswith("lattice-worker:")]
    assert len(conflict) == 1, log
    assert "another process registered --worker-id 'w1' after this one" in conflict[0]
    assert "superseded" in conflict[0] and "Traceback" not in log
    assert stack.workers["w1"].alive(), "the newer process keeps serving"

    outcome = check(stack.stub, jobs)
    assert outcome.problems == [], "\n".join(outcome.problems[:20])
    assert (outcome.acknowledged, outcome.lost, outcome.wrong_outputs) == (NUM_SEQUENCES, 0, 0)
    # No storm: nothing was lost between the two, and only what the first held when the
    # second registered went back to the queue (at most its batch of 8).
    assert _requeues(stack, "lost") == 0
    assert _requeues(stack, "reregistered") <= 8
