"""Where each request of a decisions run waited before its prompt first ran.

    .venv/bin/python -m bench.harness.waits [.artifacts/bench-vllm]

Reads the Lattice stack's requests (`requests.json`, written by bench.vllm's decisions
row) and the workers' step logs (`vllm-N.steps.jsonl`). For every request, the time from
its arrival (the load generator's send: the gateway and scheduler are on the same host)
to the start of the step that first ran its prompt, in three parts:

- until the next step: from the arrival to the start of that worker's first step after it
  (the rest of the step in flight, or the gap before the next one);
- decided already: the steps that worker started after the arrival on a decision made
  before it (with the overlap, the step after the one in flight was decided as that one
  started);
- queued on: the steps it started on decisions made after the arrival that did not take
  the request (the policy left it queued, or placed it on the other worker later).

Then the steps a worker ran with room left (fewer prompt tokens than its step limit)
while a request that had arrived before the step was decided sat in the queue, and how
the requests and their waits split between the workers, by turn.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.harness.timeline import Step, Timeline

LATTICE = "lattice, 2 vLLM workers"


@dataclass(frozen=True)
class Wait:
    seq_id: int
    turn: int
    worker: str
    arrived: float
    until_next_step: float
    decided_already: float
    queued_on: float
    ttft: float

    @property
    def total(self) -> float:
        return self.until_next_step + self.decided_already + self.queued_on


def steps_of(path: Path) -> list[Step]:
    """A worker's steps, each with the decision it ran (bench/harness/timeline.py)."""
    return [step for step in Timeline.read([path]).steps if step.decided is not None]


def waits(requests: list[dict], steps: list[Step]) -> list[Wait]:
    by_worker: dict[str, list[Step]] = {}
    for step in steps:
        by_worker.setdefault(step.worker, []).append(step)
    out = []
    for r in requests:
        seq_id, arrived = r["seq_id"], r["sent_at"]
        first = next((s for s in steps if seq_id in s.seq_ids), None) if seq_id else None
        if first is None or r["ttft"] is None:
            continue
        own = [s for s in by_worker[first.worker] if arrived <= s.started <= first.started]
        if not own:  # its worker had started the step before it was sent: clocks disagree
            continue
        before = [s for s in own if s.decided < arrived]
        after = [s for s in own if s.decided >= arrived]
        start_after = after[0].started if after else first.started
        out.append(
            Wait(
                seq_id,
                r["turn"],
                first.worker,
                arrived,
                own[0].started - arrived,
                (start_after - own[0].started) if before else 0.0,
                first.started - start_after,
                r["ttft"],
            )
        )
    return out


def busy_with_room(
    requests: list[dict], steps: list[Step], max_step_tokens: int
) -> dict[str, tuple[int, int, float]]:
    """By worker: (steps, steps with room while a request it could take was queued, their
    seconds). Queued: arrived before the step's decision and first run after that step
    started (by either worker)."""
    first_run: dict[int, float] = {}
    for step in steps:
        for seq_id in step.seq_ids:
            first_run.setdefault(seq_id, step.started)
    arrivals = [
        (r["sent_at"], first_run[r["seq_id"]]) for r in requests if r["seq_id"] in first_run
    ]
    out: dict[str, tuple[int, int, float]] = {}
    for step in steps:
        total, num, seconds = out.get(step.worker, (0, 0, 0.0))
        room = step.num_prompt_tokens + step.num_decodes < max_step_tokens
        queued = any(a < step.decided and run > step.started for a, run in arrivals)
        if room and queued:
            num, seconds = num + 1, seconds + step.ended - step.started
        out[step.worker] = (total + 1, num, seconds)
    return out


def _read(logs: Path) -> tuple[float, list[dict], list[Step]]:
    """The Lattice load's start, its requests without errors and its workers' steps over
    the load (not the warm-up), from a decisions run's `logs`."""
    load = json.loads((logs / "requests.json").read_text())[LATTICE]
    steps = sorted(
        (s for p in sorted(logs.glob("vllm-*.steps.jsonl")) for s in steps_of(p)),
        key=lambda s: s.started,
    )
    started_at = load["started_at"]
    steps = [s for s in steps if s.started >= started_at]
    return started_at, [r for r in load["requests"] if not r["error"]], steps


def summary(logs: Path) -> str:
    """One line: the waits before the first step, summed over the traced requests."""
    _, requests, steps = _read(logs)
    found = waits(requests, steps)
    return (
        f"waited before the first step {sum(w.total for w in found):.2f} s "
        f"({sum(w.until_next_step for w in found):.2f} until the next step, "
        f"{sum(w.decided_already for w in found):.2f} decided already, "
        f"{sum(w.queued_on for w in found):.2f} queued on; {len(found)} requests)"
    )


def report(logs: Path, max_step_tokens: int = 2048) -> list[str]:
    started_at, requests, steps = _read(logs)
    found = waits(requests, steps)
    lines = [f"{len(found)} of {len(requests)} requests traced (seconds, summed over them)"]
    lines += [
        "| worker | turn | requests | arrival to first step | until the next step | "
        "decided already | queued on | TTFT p50 / max |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for worker in sorted({w.worker for w in found}) + ["all"]:
        for turn in (1, 2, 3, 0):
            rows = [
                w for w in found if worker in ("all", w.worker) and (turn == 0 or w.turn == turn)
            ]
            if not rows:
                continue
            ttfts = sorted(w.ttft for w in rows)
            lines.append(
                f"| {worker} | {turn or 'all'} | {len(rows)} | {sum(w.total for w in rows):.2f} | "
                f"{sum(w.until_next_step for w in rows):.2f} | "
                f"{sum(w.decided_already for w in rows):.2f} | "
                f"{sum(w.queued_on for w in rows):.2f} | "
                f"{ttfts[len(ttfts) // 2] * 1000:.0f} / {ttfts[-1] * 1000:.0f} ms |"
            )
    lines.append("")
    lines.append("the 8 slowest first tokens: seq (turn, worker, sent s): ms until the next")
    lines.append("step + decided already + queued on; TTFT ms")
    for w in sorted(found, key=lambda w: -w.ttft)[:8]:
        lines.append(
            f"  {w.seq_id} ({w.turn}, {w.worker}, {w.arrived - started_at:.2f} s): "
            f"{w.until_next_step * 1000:.0f} + {w.decided_already * 1000:.0f} + "
            f"{w.queued_on * 1000:.0f}; {w.ttft * 1000:.0f}"
        )
    lines.append("")
    lines.append(
        f"steps with room (under {max_step_tokens} tokens) while a request sat queued "
        "(arrived before the step's decision, first run after the step started):"
    )
    for worker, (total, num, seconds) in sorted(
        busy_with_room(requests, steps, max_step_tokens).items()
    ):
        lines.append(f"  {worker}: {num} of {total} steps, {seconds:.2f} s of stepping")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", type=Path, nargs="?", default=Path(".artifacts/bench-vllm"))
    args = parser.parse_args(argv)
    print("\n".join(report(args.logs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
