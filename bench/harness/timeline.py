"""Where a burst's first tokens went: the load generator's requests against the Lattice
workers' step logs (`lattice-worker --step-log`, worker_client/step_log.py).

For each request of the burst: the worker that ran it, the decision that admitted it
(when the worker asked and when the answer came), each step its prompt ran in (when, and
the prompt tokens and decodes that step carried), the steps that worker ran before, when
its first token was made and when the client saw it. For each worker: its steps over the
burst and the time it sat between them (waiting for a decision, or with nothing to run).
Times are milliseconds from the load's start (wall clock, one host).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from worker_client.step_log import read


class Sent(Protocol):
    """What the load generator knows of a request (bench/vllm.py's `Request`)."""

    seq_id: int | None
    sent_at: float
    ttft: float | None
    turn: int
    prompt_tokens: int


@dataclass(frozen=True)
class Step:
    worker: str
    started: float
    ended: float
    chunks: tuple[tuple[int, int, int, int], ...]  # (seq_id, start, length, cached)
    num_decodes: int
    first_tokens: tuple[int, ...]
    # When the decision it ran was answered (the latest logged before it by its worker;
    # None when none was).
    decided: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return sum(chunk[2] for chunk in self.chunks)

    @property
    def seq_ids(self) -> frozenset[int]:
        """The prompts it ran a chunk of."""
        return frozenset(chunk[0] for chunk in self.chunks)


@dataclass(frozen=True)
class Admission:
    worker: str
    asked: float
    answered: float


@dataclass
class Timeline:
    """Every worker's steps in start order, and the decision that admitted each seq."""

    steps: list[Step]
    admitted: dict[int, Admission]

    @classmethod
    def read(cls, paths: Iterable[Path]) -> Timeline:
        steps, admitted = [], {}
        for path in paths:
            if not Path(path).exists():
                continue
            decided = None
            for line in read(path):
                if line["event"] == "step":
                    steps.append(
                        Step(
                            line["worker"],
                            line["started"],
                            line["ended"],
                            tuple(tuple(c) for c in line["chunks"]),
                            line["num_decodes"],
                            tuple(line["first_tokens"]),
                            decided,
                        )
                    )
                elif line["event"] == "decision":
                    decided = line["answered"]
                    for seq_id in line["admitted"]:
                        admitted[seq_id] = Admission(
                            line["worker"], line["asked"], line["answered"]
                        )
        steps.sort(key=lambda s: s.started)
        return cls(steps, admitted)

    def steps_of(self, seq_id: int) -> list[Step]:
        """The steps that ran a prompt chunk of `seq_id`, up to its first token."""
        out = []
        for step in self.steps:
            if any(c[0] == seq_id for c in step.chunks):
                out.append(step)
                if seq_id in step.first_tokens:
                    break
        return out


_HEADER = (
    "| seq | turn | prompt tokens | sent | worker: decision asked / answered | its prompt's "
    "steps: start-end (prompt tokens + decodes in the step) | steps the worker ran between "
    "its sending and its first chunk | first token made | seen by the client |",
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
)


def burst_lines(
    requests: Sequence[Sent], started_at: float, timeline: Timeline, window_seconds: float = 0.5
) -> list[str]:
    """The per-request and per-worker lines for the first turns sent in the load's first
    `window_seconds`."""
    burst = sorted(
        (
            r
            for r in requests
            if r.turn == 1 and r.seq_id is not None and r.sent_at - started_at < window_seconds
        ),
        key=lambda r: r.sent_at,
    )
    if not burst:
        return []
    lines = [
        f"opening burst: {len(burst)} first turns sent in the first {window_seconds} s "
        "(ms from the load's start)",
        *_HEADER,
    ]
    last_first_token = started_at
    for r in burst:
        row, made = _row(r, started_at, timeline)
        lines.append(row)
        if made is not None:
            last_first_token = max(last_first_token, made)
    for worker in sorted({s.worker for s in timeline.steps}):
        steps = [
            s
            for s in timeline.steps
            if s.worker == worker and started_at <= s.started <= last_first_token
        ]
        if not steps:
            lines.append(f"  {worker}: no step until the burst's last first token")
            continue
        busy = sum(s.ended - s.started for s in steps)
        idle = steps[-1].ended - started_at - busy
        cells = ", ".join(
            f"{_ms(s.started, started_at)}-{_ms(s.ended, started_at)} "
            f"({s.num_prompt_tokens} + {s.num_decodes})"
            for s in steps
        )
        lines.append(
            f"  {worker}: {len(steps)} steps, {busy * 1000:.0f} ms stepping and "
            f"{idle * 1000:.0f} ms not, from the start to its last step: {cells}"
        )
    return lines


def slowest_lines(
    requests: Sequence[Sent], started_at: float, timeline: Timeline, num: int = 4
) -> list[str]:
    """The per-request lines of the `num` slowest first tokens of the load."""
    slowest = sorted(
        (r for r in requests if r.seq_id is not None and r.ttft is not None),
        key=lambda r: -r.ttft,
    )[:num]
    if not slowest:
        return []
    return [
        f"the {len(slowest)} slowest first tokens (ms from the load's start)",
        *_HEADER,
        *(_row(r, started_at, timeline)[0] for r in slowest),
    ]


def _ms(t: float, started_at: float) -> str:
    return f"{(t - started_at) * 1000:.0f}"


def _row(r: Sent, started_at: float, timeline: Timeline) -> tuple[str, float | None]:
    """One request's table row, and when its first token was made (None: not logged)."""
    admission = timeline.admitted.get(r.seq_id)
    own = timeline.steps_of(r.seq_id)
    head = f"| {r.seq_id} | {r.turn} | {r.prompt_tokens} | {_ms(r.sent_at, started_at)} |"
    if admission is None or not own:
        return f"{head} not in the logs |", None
    cells = ", ".join(
        f"{_ms(s.started, started_at)}-{_ms(s.ended, started_at)} "
        f"({s.num_prompt_tokens} + {s.num_decodes})"
        for s in own
    )
    before = sum(
        1
        for s in timeline.steps
        if s.worker == admission.worker and r.sent_at <= s.started < own[0].started
    )
    seen = _ms(r.sent_at + r.ttft, started_at) if r.ttft is not None else "-"
    made = own[-1].ended if r.seq_id in own[-1].first_tokens else None
    row = (
        f"{head} {admission.worker}: {_ms(admission.asked, started_at)} / "
        f"{_ms(admission.answered, started_at)} | {cells} | {before} | "
        f"{'-' if made is None else _ms(made, started_at)} | {seen} |"
    )
    return row, made
