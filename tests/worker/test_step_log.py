"""`lattice-worker --step-log`: one JSON line per decision and per engine step, in turn and
overlapped, that line up with what ran (worker_client/step_log.py)."""

from __future__ import annotations

import threading

import pytest

from lattice.scheduler.v1 import scheduler_pb2 as pb
from tests.worker.scripted_client import ScriptedClient
from worker_client.client import WorkerResources
from worker_client.loop import WorkerLoop
from worker_client.step_log import StepLog, read
from worker_client.testing import ScriptedEngine

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def _decisions() -> list[pb.SchedulerDecision]:
    spec = pb.SequenceSpec(prompt_token_ids=PROMPT, max_new_tokens=3)
    return [
        pb.SchedulerDecision(
            iteration=1, prefill=[pb.PrefillChunk(seq_id=7, chunk_start=0, chunk_len=5, spec=spec)]
        ),
        pb.SchedulerDecision(
            iteration=2, prefill=[pb.PrefillChunk(seq_id=7, chunk_start=5, chunk_len=3)]
        ),
        pb.SchedulerDecision(iteration=3, decode=[7]),
        pb.SchedulerDecision(iteration=4, decode=[7]),
    ]


@pytest.mark.parametrize("overlap", [False, True])
def test_the_step_log_names_each_steps_chunks_and_the_first_token(tmp_path, overlap):
    engine, stop = ScriptedEngine(total_kv_pages=64), threading.Event()
    client = ScriptedClient(_decisions(), stop)
    path = tmp_path / "steps.jsonl"
    log = StepLog(path, "w0")
    resources = WorkerResources("w0", engine.total_kv_pages, engine.page_size, 4)
    loop = WorkerLoop(
        engine, client, resources, idle_sleep_seconds=0.001, overlap=overlap, step_log=log
    )
    loop.run(stop)
    log.close()
    lines = read(path)
    steps = [line for line in lines if line["event"] == "step"]
    decisions = [line for line in lines if line["event"] == "decision"]
    assert [s["chunks"] for s in steps] == [[[7, 0, 5, 0]], [[7, 5, 3, 0]], [], []]
    assert [s["num_decodes"] for s in steps] == [0, 0, 1, 1]
    # The first token comes with the prompt's last chunk, not before, not after.
    assert [s["first_tokens"] for s in steps] == [[], [7], [], []]
    assert [d["iteration"] for d in decisions] == [1, 2, 3, 4]
    assert decisions[0]["admitted"] == [7]
    assert all(line["worker"] == "w0" for line in lines)
    for decision, step in zip(decisions, steps):
        # A step runs after its decision came, and took time of its own.
        assert decision["asked"] <= decision["answered"] <= step["started"] <= step["ended"]
    for before, after in zip(steps, steps[1:]):
        assert before["ended"] <= after["started"]


def test_a_torn_last_line_is_skipped(tmp_path):
    path = tmp_path / "steps.jsonl"
    path.write_text('{"event": "step", "worker": "w0"}\n{"event": "st')
    assert read(path) == [{"event": "step", "worker": "w0"}]
