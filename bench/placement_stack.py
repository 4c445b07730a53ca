#!/usr/bin/env python3
"""Cache-aware placement in the real system, run after run (issue 32's real-system row;
docs/policies.md, "In the real system").

Each round starts the stack twice, with `--prefix-caching on` and `off` (which goes first
alternates by round): a scheduler (`--tpot-target-ms 1000`, so that a worker's patience
for a prefix's holder is its learned step time), two `lattice-worker` processes on the
demo checkpoint with `--cache-block-tokens 16`, and the gateway. All conversations start
at once through the gateway's chat completions, greedy, 12 new tokens a turn.

Per run it prints: follow-up turns resumed from their prefix (cached tokens at least the
previous turn's prompt less one block), those past the second turn, each worker's share of
the sequences (from its exit line), the decisions that deferred for placement, the
admissions away from the worker holding a longer prefix by the placement rule that let
them (`placement_passed_total{reason}`), each request's time to its whole answer
(follow-ups' p50, p90 and max) and the run's wall time; and whether the greedy text
equals the other setting's in that round. Then the resumed share and the smaller
worker's share over the rounds, and the passed hits by rule.

    .venv/bin/python -m bench.placement_stack                     # 8 conversations of 3 turns
    .venv/bin/python -m bench.placement_stack --conversations 16 --turns 4 --rounds 3

`tests/gateway/test_placement_stack.py` runs one round of 16 conversations of 4 turns
with the same pieces.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.harness.processes import scrape
from bench.harness.tables import pct, print_table
from common.processes import CPU_ONE_THREAD
from common.stacks import gateway_stack
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from service.core.vocabulary import PlacementPass

BLOCK_TOKENS = 16  # the workers' --cache-block-tokens (one page): a strict test
# With a latency target a worker's patience for a prefix's holder is its learned step
# time, which follows the machine's load; no step here comes near this target.
LATENCY_TARGET_MS = "1000"
NEW_TOKENS = 12
QUESTIONS = [
    "Tell me about queue number {i}.",
    "And then what happened?",
    "Say it again, shorter.",
    "Thank you; one last word?",
]
WORKER_IDS = ("w0", "w1")
WORKER_FLAGS = (*CPU_ONE_THREAD, "--cache-block-tokens", str(BLOCK_TOKENS))
CACHED = ("lattice_scheduler_prefill_tokens_total", (("source", "cached"),))
MISSES = ("lattice_scheduler_cache_misses_total", ())
DEFERRED = ("lattice_scheduler_admissions_blocked_total", (("reason", "placement"),))
PASSED = {
    rule: ("lattice_scheduler_placement_passed_total", (("reason", rule.value),))
    for rule in PlacementPass
}


@dataclass(frozen=True)
class Turn:
    conversation: int
    turn: int
    text: str
    prompt_len: int
    cached_tokens: int
    seq_id: int
    seconds: float  # from the request to its whole answer


@contextmanager
def two_worker_stack(
    model_dir: Path, logs: Path, prefix_caching: str
) -> Iterator[tuple[str, pb_grpc.SchedulerStub, int]]:
    """(the gateway's URL, a stub of the scheduler, its metrics port) of a running stack;
    every process stopped on the way out (a worker's exit line: `sequences_finished`)."""
    logs.mkdir(parents=True, exist_ok=True)
    # Ready once both have reported (the registration is committed before its answer, so
    # a worker reports tens of ms after GetStatus lists it): a fleet that serves has heard
    # from its workers, and a burst sent into that window measures the start.
    with gateway_stack(
        logs,
        model_dir,
        scheduler_flags=("--prefix-caching", prefix_caching, "--tpot-target-ms", LATENCY_TARGET_MS),
        workers=[(worker_id, WORKER_FLAGS) for worker_id in WORKER_IDS],
        ready=_reported,
        what="both workers to register and report",
    ) as stack:
        yield stack.base_url, stack.stub, stack.metrics_port


def _reported(workers) -> bool:
    return len(workers) == len(WORKER_IDS) and all(w.iteration > 0 for w in workers)


def conversations(
    base_url: str, model: str, stub, num_conversations: int, num_turns: int
) -> list[Turn]:
    """Every conversation at once, each turn sent when the last was answered; the turns in
    (conversation, turn) order."""
    import openai

    client = openai.OpenAI(
        base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120.0
    )

    def converse(i: int) -> list[Turn]:
        messages, turns = [], []
        for turn, question in enumerate(QUESTIONS[:num_turns]):
            messages.append({"role": "user", "content": question.format(i=i)})
            started = time.monotonic()
            answer = client.chat.completions.create(
                model=model, messages=messages, max_tokens=NEW_TOKENS, temperature=0.0
            )
            seconds = time.monotonic() - started
            text = answer.choices[0].message.content
            messages.append({"role": "assistant", "content": text})
            seq_id = int(answer.id.rsplit("-", 1)[1])
            info = stub.GetSequence(pb.GetSequenceRequest(seq_id=seq_id), timeout=10)
            turns.append(Turn(i, turn, text, info.prompt_len, info.cached_tokens, seq_id, seconds))
        return turns

    with ThreadPoolExecutor(num_conversations) as pool:
        runs = list(pool.map(converse, range(num_conversations)))
    client.close()
    return [turn for run in runs for turn in run]


def resumed(turns: list[Turn]) -> list[Turn]:
    """The follow-ups that resumed from their conversation's last turn: their cached
    tokens reach the previous prompt less one block."""
    by_turn = {(t.conversation, t.turn): t for t in turns}
    return [
        t
        for t in turns
        if t.turn > 0
        and t.cached_tokens >= by_turn[t.conversation, t.turn - 1].prompt_len - BLOCK_TOKENS
    ]


def sequences_finished(logs: Path, worker_id: str) -> int:
    """What the worker's exit line says it finished (a finished sequence's worker_id is
    empty on GetSequence: the contract names it only while assigned)."""
    line = re.search(
        rf"lattice-worker {worker_id}: .* (\d+) sequences finished",
        (logs / f"{worker_id}.log").read_text(),
    )
    if line is None:
        raise RuntimeError(f"{worker_id} printed no exit line (see {logs / worker_id}.log)")
    return int(line.group(1))


@dataclass(frozen=True)
class Run:
    turns: list[Turn]
    metrics: dict
    served: dict[str, int]
    wall_seconds: float


def run_once(model_dir: Path, logs: Path, prefix_caching: str, args) -> Run:
    with two_worker_stack(model_dir, logs, prefix_caching) as (base_url, stub, metrics_port):
        started = time.monotonic()
        turns = conversations(base_url, model_dir.name, stub, args.conversations, args.turns)
        wall = time.monotonic() - started
        metrics = scrape(metrics_port, timeout_seconds=10)
    served = {worker_id: sequences_finished(logs, worker_id) for worker_id in WORKER_IDS}
    return Run(turns, metrics, served, wall)


def _ms(values: list[float], percent: float) -> str:
    return f"{pct(values, percent) * 1000:.0f}"


def answer_ratios(on: Run, off: Run) -> tuple[float, float]:
    """The follow-ups' time to their whole answer, caching on over off: (p50, p90)."""
    on_s = [t.seconds for t in on.turns if t.turn > 0]
    off_s = [t.seconds for t in off.turns if t.turn > 0]
    return tuple(pct(on_s, p) / pct(off_s, p) for p in (50, 90))


def passed_hits(run: Run) -> dict[PlacementPass, int]:
    """Admissions away from the worker holding the longest prefix, by placement rule."""
    return {rule: round(run.metrics.get(key, 0)) for rule, key in PASSED.items()}


def row(round_no: int, setting: str, run: Run, same_text: bool) -> list[object]:
    follow_ups = [t for t in run.turns if t.turn > 0]
    kept = resumed(run.turns)
    later = sum(t.turn > 1 for t in kept)
    num_later = sum(t.turn > 1 for t in follow_ups)
    seconds = [t.seconds for t in follow_ups]
    share = min(run.served.values()) / max(1, sum(run.served.values()))
    return [
        f"{round_no} {setting}",
        f"{len(kept)} / {len(follow_ups)}",
        f"{later} / {num_later}",
        " / ".join(str(run.served[w]) for w in WORKER_IDS),
        f"{share:.2f}",
        f"{run.metrics.get(DEFERRED, 0):.0f}",
        " / ".join(str(n) for n in passed_hits(run).values()),
        f"{run.metrics.get(MISSES, 0):.0f}",
        f"{_ms(seconds, 50)} / {_ms(seconds, 90)} / {_ms(seconds, 100)}",
        f"{run.wall_seconds:.2f}",
        "yes" if same_text else "NO",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3, help=f"2-{len(QUESTIONS)}")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", type=Path, help="a checkpoint directory (default: the demo)")
    parser.add_argument("--logs", type=Path, help="keep the processes' logs here")
    args = parser.parse_args(argv)
    if not 2 <= args.turns <= len(QUESTIONS):  # a follow-up needs a second turn
        parser.error(f"--turns must be within 2-{len(QUESTIONS)}, got {args.turns}")
    if not 1 <= args.conversations <= 64:
        parser.error(f"--conversations must be within 1-64, got {args.conversations}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    # The demo checkpoint and the logs (unless --logs keeps them) go with a run that ends
    # well; a failed one keeps them, as its error points there.
    scratch = Path(tempfile.mkdtemp(prefix="lattice-placement-stack-"))
    logs = args.logs or scratch / "logs"
    try:
        model_dir = args.model
        if model_dir is None:
            from worker_client.demo_model import write_demo_checkpoint

            model_dir = scratch / "tiny-qwen35-chat"
            model_dir.mkdir()
            write_demo_checkpoint(model_dir)
        rows, shares, resumed_shares, ratios = [], [], [], []
        passed = dict.fromkeys(PlacementPass, 0)
        for round_no in range(1, args.rounds + 1):
            order = ("on", "off") if round_no % 2 else ("off", "on")
            runs = {}
            for setting in order:
                print(
                    f"round {round_no}/{args.rounds}: caching {setting}, load average "
                    f"{os.getloadavg()[0]:.2f}",
                    file=sys.stderr,
                    flush=True,
                )
                runs[setting] = run_once(model_dir, logs / f"{round_no}-{setting}", setting, args)
            same = [t.text for t in runs["on"].turns] == [t.text for t in runs["off"].turns]
            for setting in ("on", "off"):
                rows.append(row(round_no, setting, runs[setting], same))
            on = runs["on"]
            resumed_shares.append(
                len(resumed(on.turns)) / max(1, sum(t.turn > 0 for t in on.turns))
            )
            shares.append(min(on.served.values()) / max(1, sum(on.served.values())))
            ratios.append(answer_ratios(on, runs["off"]))
            for rule, n in passed_hits(on).items():
                passed[rule] += n
        print(
            f"\n{args.conversations} conversations of {args.turns} turns, 2 workers, "
            f"{args.rounds} round(s), load average {os.getloadavg()[0]:.2f} on "
            f"{os.cpu_count()} cores\n"
        )
        print_table(
            [
                "round, caching",
                "follow-ups resumed",
                "past the second turn",
                "sequences w0 / w1",
                "smaller share",
                "deferred for placement",
                "hits passed: " + " / ".join(rule.value for rule in PlacementPass),
                "cache misses",
                "follow-ups, answer ms p50 / p90 / max",
                "wall s",
                "same text",
            ],
            rows,
        )
        print(
            f"\ncaching on: follow-ups resumed {statistics.mean(resumed_shares):.3f} on average "
            f"(runs {', '.join(f'{s:.2f}' for s in resumed_shares)}), at least 0.9 in "
            f"{sum(s >= 0.9 for s in resumed_shares)} of {len(resumed_shares)}; the smaller "
            f"worker's share {min(shares):.2f}-{max(shares):.2f}"
        )
        print(
            "hits passed by placement, caching on, all rounds: "
            + ", ".join(f"{rule.value} {n}" for rule, n in passed.items())
        )
        # What the cache and placement cost or save the follow-ups, run beside run.
        p50s, p90s = [r[0] for r in ratios], [r[1] for r in ratios]
        print(
            f"follow-ups' answer time, caching on / off: p50 {statistics.median(p50s):.2f}x "
            f"(rounds {', '.join(f'{r:.2f}' for r in p50s)}), p90 "
            f"{statistics.median(p90s):.2f}x (rounds {', '.join(f'{r:.2f}' for r in p90s)}), "
            "medians over the rounds"
        )
    except BaseException:
        print(f"logs in {logs}", file=sys.stderr)
        raise
    shutil.rmtree(scratch)
    if args.logs:
        print(f"logs in {args.logs}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
