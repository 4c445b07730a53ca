"""Cache-aware placement in the real system (docs/policies.md, "Placement"): a scheduler,
two CPU workers serving the tiny chat model with prefix caches, and the gateway, each
its own process; 16 conversations of 4 turns each, sent at once through the gateway.

Follow-up turns should land on the worker that served the conversation's last turn and
resume from its cache (how long another worker leaves one to it follows the machine's
load: bench/placement_stack.py's LATENCY_TARGET_MS), the scheduler's metrics should
count what they resumed, the conversations should spread over both workers, and the
greedy text should be the same with --prefix-caching off."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.harness.processes import scrape
from bench.placement_stack import (
    CACHED,
    DEFERRED,
    MISSES,
    WORKER_IDS,
    conversations,
    resumed,
    sequences_finished,
    two_worker_stack,
)

from .checkpoint import Checkpoint

pytestmark = pytest.mark.slow

NUM_CONVERSATIONS = 4 * 4
NUM_TURNS = 4
NUM_FOLLOW_UPS = NUM_CONVERSATIONS * (NUM_TURNS - 1)  # 48
# A worker leaves a follow-up to the worker that holds its conversation for as long as
# its own prefill would take, and until the holder has asked once since the follow-up was
# queued (up to the holder's measured time between calls: on fast steps the report's
# round trip is most of it). Without a latency target the prefill is the cautious default
# model's guess (26 ms for these prefixes); with one it is each worker's learned step
# time, which follows the load, so the stack (bench/placement_stack.py) sets a target
# that no step here comes near.
#
# A follow-up resumes only on the worker that served its conversation's last turn. Placed
# at random over the two workers, each of the 48 does so with probability 1/2: 24 on
# average (standard deviation 3.5). Measured (docs/policies.md, "In the real system"):
# before near ties went to the cached prefix 28, 38 and 42 on an idle machine (most
# misses a second turn priced a few ms cheaper cold than on its busy holder); since,
# eleven runs at load 1.7-9.1: 36-48, mean 43.1 (the misses left: a holder at its cap or
# with no free GDN slot, and second turns whose holder is loaded by two or more sequences
# more than the asker); since the stack waits for both workers' first reports (stop 45),
# four runs at load 1.1-1.5: 41, 34, 42, 46 (mean 40.8). Issue 32's target (0.9, 43) is
# met on average in some sessions, not by every run; the floor, below the runs before and
# after, catches only a collapse (random placement's 24);
# tests/unit/test_placement.py holds the near-tie rule. The placement deferrals counted
# below tell the rule from no rule.
MIN_RESUMED = 30


def test_conversations_resume_on_the_worker_that_holds_them_spread_and_answer_the_same(
    checkpoint: Checkpoint, tmp_path: Path
):
    pytest.importorskip("openai")
    results, metrics = {}, {}
    for setting in ("on", "off"):
        with two_worker_stack(checkpoint.path, tmp_path / setting, setting) as (
            base_url,
            stub,
            metrics_port,
        ):
            results[setting] = conversations(
                base_url, checkpoint.path.name, stub, NUM_CONVERSATIONS, NUM_TURNS
            )
            metrics[setting] = scrape(metrics_port, timeout_seconds=10)
    on, off = results["on"], results["off"]
    by_turn = {(t.conversation, t.turn): t for t in on}
    follow_ups = [t for t in on if t.turn > 0]
    kept = resumed(on)
    later = [t for t in kept if t.turn > 1]  # past the second turn: hits worth a wait
    served = {worker_id: sequences_finished(tmp_path / "on", worker_id) for worker_id in WORKER_IDS}
    print(
        f"follow-ups resumed: {len(kept)} of {len(follow_ups)} ({len(later)} of the "
        f"{NUM_CONVERSATIONS * (NUM_TURNS - 2)} past the second turn); cached prompt tokens "
        f"{sum(t.cached_tokens for t in on)} of {sum(t.prompt_len for t in on)} (the "
        f"scheduler's count {metrics['on'][CACHED]:.0f}, misses {metrics['on'][MISSES]:.0f}); "
        f"decisions that deferred for placement {metrics['on'].get(DEFERRED, 0):.0f}; "
        f"sequences per worker {served}"
    )
    assert len(follow_ups) == NUM_FOLLOW_UPS
    assert len(kept) >= MIN_RESUMED, [
        (t.conversation, t.turn, t.cached_tokens, by_turn[t.conversation, t.turn - 1].prompt_len)
        for t in follow_ups
    ]
    # The scheduler counts what the sequences resumed: a first chunk's cached tokens, at
    # admission (a resume point lost before the worker used it is a miss, counted there too).
    if metrics["on"][MISSES] == 0:
        assert metrics["on"][CACHED] == sum(t.cached_tokens for t in on)
    assert metrics["on"][CACHED] >= sum(t.cached_tokens for t in on)
    # The rule at work: some worker left a sequence to a better placed one; with the caches
    # off the rule never runs.
    assert metrics["on"].get(DEFERRED, 0) > 0
    assert metrics["off"].get(DEFERRED, 0) == 0
    assert sum(served.values()) == len(on), served  # each request ran once
    assert all(n >= 0.3 * len(on) for n in served.values()), served
    assert all(t.cached_tokens == 0 for t in off)
    assert [(t.conversation, t.turn, t.text) for t in on] == [
        (t.conversation, t.turn, t.text) for t in off
    ]
