"""Kill things mid-run; nothing acknowledged is lost, and every output is counted.

Each test runs a real scheduler process (--state-dir, lease 2 s unless said) and two
scripted worker processes (--step-ms 10: a step with work takes 10 ms, so sequences are
still running when the kill lands), submits sequences with unique request_ids, and
collects every acknowledged sequence by re-attaching Generate streams. `check` then
asks, for each: known, FINISHED once with the reference finish reason, exactly the
reference tokens (none missing, none twice), and one seq_id for its request_id.
"""

from __future__ import annotations

import time

import pytest

from bench.harness.fault_stack import Job, check_known, make_jobs
from common.waiting import wait_until
from lattice.scheduler.v1 import scheduler_pb2 as pb
from tests.faults.outcome import assert_nothing_lost

pytestmark = pytest.mark.slow

NUM_SEQUENCES = 50
DONE_TIMEOUT_SECONDS = 45.0


def _unfinished(jobs: list[Job]) -> int:
    return sum(j.seq_id is not None and j.finish_reason is None for j in jobs)


def _assert_all_good(stack, jobs: list[Job]) -> None:
    assert_nothing_lost(stack.stub, jobs)


def _requeues(stack, reason: str) -> float:
    return stack.metrics().get(("lattice_scheduler_requeues_total", (("reason", reason),)), 0.0)


def test_scheduler_killed_mid_run_loses_no_acknowledged_sequence_and_each_finishes_once(
    make_stack, make_clients
):
    stack = make_stack()
    jobs = make_jobs(NUM_SEQUENCES, seed=1)
    clients = make_clients(stack, jobs)
    clients.wait_acknowledged(20, timeout=20)
    stack.kill_scheduler()
    # The kill landed mid-run: submits still to come, acknowledged sequences unfinished.
    assert clients.num_acknowledged < len(jobs) and _unfinished(jobs) > 0
    stack.start_scheduler()
    assert check_known(stack.stub, jobs) == []
    clients.wait_done(DONE_TIMEOUT_SECONDS)
    _assert_all_good(stack, jobs)
    assert clients.num_reattachments > 0  # streams really were cut and re-attached


def test_two_scheduler_kills_the_second_during_recovery_lose_nothing(make_stack, make_clients):
    stack = make_stack()
    jobs = make_jobs(NUM_SEQUENCES, seed=2)
    clients = make_clients(stack, jobs)
    clients.wait_acknowledged(15, timeout=20)
    stack.restart_scheduler()
    # Kill again as soon as a recovered worker reconciles with the new incarnation.
    stack.wait_workers(1, timeout=20)
    assert _unfinished(jobs) > 0
    stack.kill_scheduler()
    stack.start_scheduler()
    assert check_known(stack.stub, jobs) == []
    clients.wait_done(DONE_TIMEOUT_SECONDS)
    _assert_all_good(stack, jobs)


def test_killed_worker_sequences_finish_on_the_other_worker_after_the_lease(
    make_stack, make_clients
):
    stack = make_stack(lease_ttl_ms=2000)
    jobs = make_jobs(NUM_SEQUENCES, seed=3)
    clients = make_clients(stack, jobs, submit_interval_seconds=0.01)
    victim = _wait_holding(stack, 3)
    stack.kill_worker(victim)
    killed_at = time.monotonic()
    held = _held_by(stack, jobs, victim)
    assert held, f"{victim} held nothing when it was killed"
    clients.wait_done(DONE_TIMEOUT_SECONDS)
    _assert_all_good(stack, jobs)
    # Only the lease could free them: nothing of theirs finished before it ran out
    # (with a margin for the time between the victim's last call and the kill).
    early = [j.request_id for j in held if j.finished_at < killed_at + 0.5 * 2.0]
    assert early == []
    assert _requeues(stack, "lease_expired") >= 1
    assert victim not in stack.worker_status()


def test_worker_restarted_under_the_same_id_loses_and_doubles_nothing(make_stack, make_clients):
    # A long lease, so that the new process registers well before the old one's lease ends
    # (a worker process can take several seconds to start on a loaded machine).
    stack = make_stack(lease_ttl_ms=30_000)
    jobs = make_jobs(NUM_SEQUENCES, seed=4)
    clients = make_clients(stack, jobs, submit_interval_seconds=0.01)
    victim = _wait_holding(stack, 3)
    stack.kill_worker(victim)
    held = _held_by(stack, jobs, victim)
    stack.start_worker(victim)
    clients.wait_done(DONE_TIMEOUT_SECONDS)
    _assert_all_good(stack, jobs)
    # The new incarnation took the old one's sequences back by registering, not by lease.
    assert held and _requeues(stack, "reregistered") >= 1
    assert _requeues(stack, "lease_expired") == 0
    assert stack.workers[victim].alive() and stack.worker_status()[victim].iteration > 0


def test_seq_ids_are_never_reused_after_a_restart(make_stack, make_clients):
    stack = make_stack()
    jobs = make_jobs(40, seed=5)
    clients = make_clients(stack, jobs)
    clients.wait_acknowledged(15, timeout=20)
    stack.kill_scheduler()
    killed_at = time.monotonic()
    stack.start_scheduler()
    restarted_at = stack.restarts[-1].listening_at
    clients.wait_done(DONE_TIMEOUT_SECONDS)
    _assert_all_good(stack, jobs)
    before = [j.seq_id for j in jobs if j.acknowledged_at < killed_at]
    after = [j.seq_id for j in jobs if j.first_sent_at > restarted_at]
    assert before and after
    assert min(after) > max(before), (sorted(before), sorted(after))


@pytest.mark.parametrize("fsync", ["acks", "always"])
def test_a_kill_during_a_burst_of_concurrent_submits_loses_no_acknowledged_one(
    make_stack, make_clients, fsync
):
    """Group commit: 16 submitters at once, each Submit answered only after an fsync that
    covers it; kill -9 mid-burst; every acknowledged sequence is there after the restart
    and finishes once with its reference tokens. (That one fsync answers several waiting
    Submits is shown with a slow fsync in tests/server/test_group_commit.py: here, on a
    fast disk, the restarted scheduler's retried Submits may each get their own.)"""
    stack = make_stack(scheduler_flags=("--state-fsync", fsync))
    jobs = make_jobs(160, seed=9, max_new_tokens_range=(4, 12))
    clients = make_clients(stack, jobs, submit_interval_seconds=0.0, num_submitters=16)
    clients.wait_acknowledged(40, timeout=20)
    stack.kill_scheduler()
    assert clients.num_acknowledged < len(jobs)
    stack.start_scheduler()
    assert check_known(stack.stub, jobs) == []
    clients.wait_done(DONE_TIMEOUT_SECONDS)
    _assert_all_good(stack, jobs)
    metrics = stack.metrics()
    fsyncs = metrics[("lattice_scheduler_state_fsyncs_total", ())]
    commits = metrics[("lattice_scheduler_state_commits_per_fsync_sum", ())]
    assert commits >= fsyncs > 0, (commits, fsyncs)  # every fsync answered a commit


def _wait_holding(stack, count: int, timeout: float = 20.0) -> str:
    """The id of a worker that holds at least `count` sequences, once one does."""
    busiest = wait_until(
        lambda: max(stack.worker_status().values(), key=lambda w: w.num_assigned),
        f"a worker holding {count} sequences",
        timeout,
        done=lambda w: w.num_assigned >= count,
        every_seconds=0.01,
    )
    return busiest.worker_id


def _held_by(stack, jobs: list[Job], worker_id: str) -> list[Job]:
    """Jobs the scheduler has assigned to `worker_id` now."""
    held = []
    for job in jobs:
        if job.seq_id is None:
            continue
        info = stack.stub.GetSequence(pb.GetSequenceRequest(seq_id=job.seq_id), timeout=5)
        if info.worker_id == worker_id and info.state != pb.SEQUENCE_STATE_FINISHED:
            held.append(job)
    return held


def test_worker_killed_while_the_scheduler_is_down_loses_its_sequences_only_to_the_lease(
    make_stack, make_clients
):
    # The restarted scheduler recovers the dead worker as registered, holding what it
    # held; it never calls again, so only its lease can hand those sequences on.
    stack = make_stack(lease_ttl_ms=2000)
    jobs = make_jobs(NUM_SEQUENCES, seed=6)
    clients = make_clients(stack, jobs, submit_interval_seconds=0.01)
    victim = _wait_holding(stack, 3)
    stack.kill_scheduler()
    stack.kill_worker(victim)
    stack.start_scheduler()
    held = _held_by(stack, jobs, victim)
    assert held and victim in stack.worker_status()
    clients.wait_done(DONE_TIMEOUT_SECONDS)
    _assert_all_good(stack, jobs)
    assert _requeues(stack, "lease_expired") >= 1
    assert victim not in stack.worker_status()


def test_worker_frozen_past_its_lease_is_refused_registers_again_and_nothing_is_lost(
    make_stack, make_clients
):
    stack = make_stack(lease_ttl_ms=2000)
    jobs = make_jobs(NUM_SEQUENCES, seed=7)
    clients = make_clients(stack, jobs, submit_interval_seconds=0.01)
    victim = _wait_holding(stack, 3)
    # Frozen mid-step with tokens it has not reported: they arrive late, from a worker
    # the scheduler has dropped, and must not be applied.
    stack.freeze(stack.workers[victim], 3.5)
    clients.wait_done(DONE_TIMEOUT_SECONDS)
    _assert_all_good(stack, jobs)
    assert _requeues(stack, "lease_expired") >= 1
    assert "no longer knows this worker" in stack.workers[victim].log_text()
    # Registered again, and working: its first report after registering may still be on
    # its way (a registration counts no iteration).
    wait_until(
        lambda: stack.worker_status()[victim].iteration > 0,
        "the frozen worker to report again after registering",
        10,
    )


def test_scheduler_frozen_past_the_lease_keeps_its_calling_workers(make_stack, make_clients):
    stack = make_stack(lease_ttl_ms=2000)
    jobs = make_jobs(NUM_SEQUENCES, seed=8)
    clients = make_clients(stack, jobs, submit_interval_seconds=0.01)
    _wait_holding(stack, 3)
    stack.freeze(stack.scheduler, 3.5)
    clients.wait_done(DONE_TIMEOUT_SECONDS)
    _assert_all_good(stack, jobs)  # nothing is lost either way: only work is thrown away
    dropped = [w for w, p in stack.workers.items() if "no longer knows this worker" in p.log_text()]
    assert dropped == [] and _requeues(stack, "lease_expired") == 0


def test_worker_killed_while_its_cached_pages_are_shared_loses_nothing(make_stack, make_clients):
    """Prefix caching on (the scheduler's default) and scripted workers with a cache: the
    prompts share a 64-token prefix, so sequences resume from it and share its pages;
    one worker is killed -9 while it holds several; every acknowledged sequence still
    finishes once with the reference tokens."""
    stack = make_stack(lease_ttl_ms=2000, worker_flags=("--cache-block-tokens", "16"))
    jobs = make_jobs(NUM_SEQUENCES, seed=11, shared_prefix=64)
    clients = make_clients(stack, jobs, submit_interval_seconds=0.01)
    victim = _wait_holding(stack, 3)
    cached = wait_until(
        lambda: stack.metrics().get(
            ("lattice_scheduler_prefill_tokens_total", (("source", "cached"),)), 0.0
        ),
        "prefill tokens taken from a cache",
        20.0,
        done=lambda v: v > 0,
        every_seconds=0.05,
    )
    assert cached > 0
    stack.kill_worker(victim)
    clients.wait_done(DONE_TIMEOUT_SECONDS)
    _assert_all_good(stack, jobs)
    assert _requeues(stack, "lease_expired") >= 1
