"""bench/harness/timeline.py: a burst's first tokens traced through the workers' step logs."""

from __future__ import annotations

import json
from dataclasses import dataclass

from bench.harness.timeline import Timeline, burst_lines, slowest_lines

T0 = 1000.0  # the load's start, wall clock


@dataclass
class Sent:
    seq_id: int | None
    sent_at: float
    ttft: float | None
    turn: int = 1
    prompt_tokens: int = 600


def _write(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_each_request_of_the_burst_is_traced_to_its_steps_and_worker(tmp_path):
    _write(
        tmp_path / "w1.jsonl",
        [
            {"event": "decision", "worker": "w1", "asked": T0 - 0.05, "answered": T0 + 0.01,
             "iteration": 1, "admitted": [3], "num_chunks": 1, "num_decodes": 0},
            {"event": "step", "worker": "w1", "started": T0 + 0.01, "ended": T0 + 0.05,
             "chunks": [[3, 0, 512, 0]], "num_decodes": 0, "first_tokens": []},
            {"event": "decision", "worker": "w1", "asked": T0 + 0.01, "answered": T0 + 0.02,
             "iteration": 2, "admitted": [4], "num_chunks": 2, "num_decodes": 0},
            {"event": "step", "worker": "w1", "started": T0 + 0.05, "ended": T0 + 0.12,
             "chunks": [[3, 512, 88, 0], [4, 0, 512, 0]], "num_decodes": 0,
             "first_tokens": [3]},
        ],
    )  # fmt: skip
    timeline = Timeline.read([tmp_path / "w1.jsonl", tmp_path / "absent.jsonl"])
    requests = [
        Sent(3, T0 + 0.001, 0.13),
        Sent(4, T0 + 0.002, None),
        Sent(5, T0 + 0.9, 0.1),  # after the burst
        Sent(6, T0 + 0.003, 0.1, turn=2),  # not a first turn
    ]
    lines = burst_lines(requests, T0, timeline)
    rows = [line for line in lines if line.startswith("| 3 ") or line.startswith("| 4 ")]
    assert rows[0] == (
        "| 3 | 1 | 600 | 1 | w1: -50 / 10 | 10-50 (512 + 0), 50-120 (600 + 0) | 0 | 120 | 131 |"
    )
    # Seq 4 has no first token in the logs yet: its steps so far, no time seen.
    assert rows[1].startswith("| 4 | 1 | 600 | 2 | w1: 10 / 20 | 50-120 (600 + 0) | 1 |")
    assert rows[1].endswith("| 1 | - | - |")
    assert len(rows) == 2
    assert lines[-1].startswith("  w1: 2 steps, 110 ms stepping and 10 ms not")
    slowest = slowest_lines(requests, T0, timeline, num=2)
    assert [line.split(" |")[0] for line in slowest[3:]] == ["| 3", "| 5"]
    assert slowest[4].endswith("not in the logs |")
