"""Cache-aware placement in the real system (docs/policies.md, "Placement"): a scheduler,
two CPU workers serving the tiny chat model with prefix caches, and the gateway, each
its own process; 16 conversations of 4 turns each, sent at once through the gateway.

Follow-up turns should land on the worker that served the conversation's last turn and
resume from its cache (how long another worker leaves one to it follows the machine's
load: LATENCY_TARGET_MS), the scheduler's metrics should count what they resumed, the
conversations should spread over both workers, and the greedy text should be the same
with --prefix-caching off."""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from bench.harness.processes import scrape
from common.processes import (
    GATEWAY_LISTENING,
    LOOPBACK,
    SCHEDULER_LISTENING,
    START_TIMEOUT_SECONDS,
    Process,
    scheduler_argv,
    spawn,
)
from common.waiting import wait_until
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc

from .checkpoint import Checkpoint
from .processes import gateway_argv, worker_argv

pytestmark = pytest.mark.slow

BLOCK_TOKENS = 16  # the workers' --cache-block-tokens (one page): a strict test
NUM_CONVERSATIONS = 4 * 4
NUM_TURNS = 4
QUESTIONS = [
    "Tell me about queue number {i}.",
    "And then what happened?",
    "Say it again, shorter.",
    "Thank you; one last word?",
]
NUM_FOLLOW_UPS = NUM_CONVERSATIONS * (NUM_TURNS - 1)  # 48
# A worker leaves a follow-up to the worker that holds its conversation for as long as
# its own prefill would take, and until the holder has asked once since the follow-up was
# queued (up to the holder's measured time between calls: on fast steps the report's
# round trip is most of it). Without a latency target the prefill is the cautious default
# model's guess (26 ms for these prefixes); with one it is each worker's learned step
# time, which follows the load, so the test sets a target that no step here comes near.
LATENCY_TARGET_MS = "1000"
# A follow-up resumes only on the worker that served its conversation's last turn. Placed
# at random over the two workers, each of the 48 does so with probability 1/2: 24 on
# average (standard deviation 3.5). Measured (docs/policies.md, "In the real system"):
# before near ties went to the cached prefix 28, 38 and 42 on an idle machine (most
# misses a second turn priced a few ms cheaper cold than on its busy holder); since,
# eleven runs at load 1.7-9.1: 36-48, mean 43.1 (the misses left: a holder at its cap or
# with no free GDN slot, and second turns whose holder is loaded by two or more sequences
# more than the asker). Issue 32's target (0.9, 43) is met on average, not by every run; the
# floor, below the runs before and after, catches only a collapse (random placement's 24);
# tests/unit/test_placement.py holds the near-tie rule. The placement deferrals counted
# below tell the rule from no rule.
MIN_RESUMED = 30


@dataclass(frozen=True)
class Turn:
    conversation: int
    turn: int
    text: str
    prompt_len: int
    cached_tokens: int


@contextmanager
def two_worker_stack(checkpoint: Checkpoint, logs: Path, prefix_caching: str) -> Iterator[tuple]:
    started: list[Process] = []
    logs.mkdir(parents=True, exist_ok=True)
    try:
        scheduler = spawn(
            "scheduler",
            scheduler_argv(
                "--prefix-caching", prefix_caching, "--tpot-target-ms", LATENCY_TARGET_MS
            ),
            logs,
            SCHEDULER_LISTENING,
        )
        started.append(scheduler)
        target = f"{LOOPBACK}:{scheduler.ports[0]}"
        for worker_id in ("w0", "w1"):
            started.append(
                spawn(
                    worker_id,
                    [
                        *worker_argv(target, checkpoint.path, worker_id),
                        "--cache-block-tokens",
                        str(BLOCK_TOKENS),
                    ],
                    logs,
                )
            )
        gateway = spawn("gateway", gateway_argv(target, checkpoint.path), logs, GATEWAY_LISTENING)
        started.append(gateway)
        channel = grpc.insecure_channel(target)
        stub = pb_grpc.SchedulerStub(channel)
        wait_until(
            lambda: len(stub.GetStatus(pb.GetStatusRequest(), timeout=10).workers) == 2,
            "both workers to register",
            START_TIMEOUT_SECONDS,
        )
        yield (
            f"http://{LOOPBACK}:{gateway.ports[0]}",
            stub,
            scheduler.ports[1],
        )
        channel.close()
    finally:
        for process in reversed(started):
            process.stop()


def conversations(base_url: str, model: str, stub) -> list[Turn]:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(
        base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120.0
    )

    def converse(i: int) -> list[Turn]:
        messages, turns = [], []
        for turn, question in enumerate(QUESTIONS[:NUM_TURNS]):
            messages.append({"role": "user", "content": question.format(i=i)})
            answer = client.chat.completions.create(
                model=model, messages=messages, max_tokens=12, temperature=0.0
            )
            text = answer.choices[0].message.content
            messages.append({"role": "assistant", "content": text})
            seq_id = int(answer.id.rsplit("-", 1)[1])
            info = stub.GetSequence(pb.GetSequenceRequest(seq_id=seq_id), timeout=10)
            turns.append(Turn(i, turn, text, info.prompt_len, info.cached_tokens))
        return turns

    with ThreadPoolExecutor(NUM_CONVERSATIONS) as pool:
        runs = list(pool.map(converse, range(NUM_CONVERSATIONS)))
    client.close()
    return [turn for run in runs for turn in run]


def sequences_finished(logs: Path, worker_id: str) -> int:
    """What the worker's exit line says it finished (a finished sequence's worker_id is
    empty on GetSequence: the contract names it only while assigned)."""
    line = re.search(
        rf"lattice-worker {worker_id}: .* (\d+) sequences finished",
        (logs / f"{worker_id}.log").read_text(),
    )
    assert line is not None, f"{worker_id} printed no exit line"
    return int(line.group(1))


def test_conversations_resume_on_the_worker_that_holds_them_spread_and_answer_the_same(
    checkpoint: Checkpoint, tmp_path: Path
):
    results, metrics = {}, {}
    for setting in ("on", "off"):
        with two_worker_stack(checkpoint, tmp_path / setting, setting) as (
            base_url,
            stub,
            metrics_port,
        ):
            results[setting] = conversations(base_url, checkpoint.path.name, stub)
            metrics[setting] = scrape(metrics_port, timeout_seconds=10)
    on, off = results["on"], results["off"]
    by_turn = {(t.conversation, t.turn): t for t in on}
    follow_ups = [t for t in on if t.turn > 0]
    resumed = [
        t
        for t in follow_ups
        if t.cached_tokens >= by_turn[t.conversation, t.turn - 1].prompt_len - BLOCK_TOKENS
    ]
    later = [t for t in resumed if t.turn > 1]  # past the second turn: hits worth a wait
    cached = ("lattice_scheduler_prefill_tokens_total", (("source", "cached"),))
    misses = ("lattice_scheduler_cache_misses_total", ())
    deferred = ("lattice_scheduler_admissions_blocked_total", (("reason", "placement"),))
    served = {
        worker_id: sequences_finished(tmp_path / "on", worker_id) for worker_id in ("w0", "w1")
    }
    print(
        f"follow-ups resumed: {len(resumed)} of {len(follow_ups)} ({len(later)} of the "
        f"{NUM_CONVERSATIONS * (NUM_TURNS - 2)} past the second turn); cached prompt tokens "
        f"{sum(t.cached_tokens for t in on)} of {sum(t.prompt_len for t in on)} (the "
        f"scheduler's count {metrics['on'][cached]:.0f}, misses {metrics['on'][misses]:.0f}); "
        f"decisions that deferred for placement {metrics['on'].get(deferred, 0):.0f}; "
        f"sequences per worker {served}"
    )
    assert len(follow_ups) == NUM_FOLLOW_UPS
    assert len(resumed) >= MIN_RESUMED, [
        (t.conversation, t.turn, t.cached_tokens, by_turn[t.conversation, t.turn - 1].prompt_len)
        for t in follow_ups
    ]
    # The scheduler counts what the sequences resumed: a first chunk's cached tokens, at
    # admission (a resume point lost before the worker used it is a miss, counted there too).
    if metrics["on"][misses] == 0:
        assert metrics["on"][cached] == sum(t.cached_tokens for t in on)
    assert metrics["on"][cached] >= sum(t.cached_tokens for t in on)
    # The rule at work: some worker left a sequence to a better placed one; with the caches
    # off the rule never runs.
    assert metrics["on"].get(deferred, 0) > 0
    assert metrics["off"].get(deferred, 0) == 0
    assert sum(served.values()) == len(on), served  # each request ran once
    assert all(n >= 0.3 * len(on) for n in served.values()), served
    assert all(t.cached_tokens == 0 for t in off)
    assert [(t.conversation, t.turn, t.text) for t in on] == [
        (t.conversation, t.turn, t.text) for t in off
    ]
