"""kill -9 of a handoff's sender or receiver while sequences move between workers: nothing
acknowledged is lost, no token comes twice, and the greedy tokens are the model's.

A real scheduler process (lease 5 s: the engines share a loaded machine) and three
`lattice-worker` processes on the tiny Qwen3.5 model: one `--role prefill` with its
handoff channel, two `--role decode`. The
prompts are long enough (1,030-1,100 tokens) that the scheduler sends every one to the
prefill worker and hands it off. Once handoffs are under way, the prefill worker (a
sender) is killed and started again, then a decode worker (a receiver) likewise; the
expected tokens come from the reference engine run alone.
"""

from __future__ import annotations

import pytest

from bench.harness.handoff_stack import handoff_counts, handoff_jobs, start_role_worker
from common.waiting import wait_until
from tests.faults.outcome import assert_nothing_lost

pytest.importorskip("torch")

pytestmark = pytest.mark.slow

NUM_SEQUENCES = 10
ROLES = {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"}


def _start_worker(stack, worker_id: str) -> None:
    start_role_worker(stack, worker_id, ROLES[worker_id])


def _handoffs_done(stack) -> float:
    return handoff_counts(stack).get("done", 0.0)


def test_killing_a_sender_then_a_receiver_mid_handoff_loses_nothing(make_stack, make_clients):
    jobs = handoff_jobs(NUM_SEQUENCES)
    stack = make_stack(num_workers=0, lease_ttl_ms=5000)
    for worker_id in ROLES:
        _start_worker(stack, worker_id)
    stack.wait_workers(len(ROLES), timeout=60)
    # Submitted over about 10 s, so that prompts still arrive after the sender's restart
    # (while it is gone, the decode workers take them).
    clients = make_clients(stack, jobs, deadline_seconds=240, submit_interval_seconds=1.0)

    wait_until(lambda: _handoffs_done(stack) >= 1, "a first handoff", 120)
    stack.kill_worker("prefill-0")  # the sender, with prompts prefilling and in flight
    _start_worker(stack, "prefill-0")
    done = _handoffs_done(stack)
    wait_until(lambda: _handoffs_done(stack) > done, "a handoff after the sender's restart", 120)
    stack.kill_worker("decode-0")  # a receiver, holding sequences handed to it
    _start_worker(stack, "decode-0")

    clients.wait_done(240)
    assert_nothing_lost(stack.stub, jobs)
    print(f"handoffs done: {_handoffs_done(stack):g}, worker kills: {stack.worker_kills}")
