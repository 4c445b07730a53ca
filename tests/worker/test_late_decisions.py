"""Late decisions (docs/contract.md): an overlapped worker asks for the next step's
decision near the end of a long step, so a prompt that reaches the scheduler during the
step starts in the very next one. Scheduler on a loopback port, a worker loop, the
scripted engine with steps that take time."""

from __future__ import annotations

import threading

import pytest

from common.waiting import wait_until
from lattice.scheduler.v1 import scheduler_pb2 as pb
from tests.worker.conftest import WorkerThread, generate
from worker_client import convert
from worker_client.client import WorkerResources
from worker_client.testing import ScriptedEngine, reference_output

STEP_SECONDS = 0.3


class StepRecorder(ScriptedEngine):
    """A ScriptedEngine that notes each step's prompts (seq_ids with a chunk) in order and
    signals each step's start."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.prompts_by_step: list[set[int]] = []
        self.step_started = threading.Event()

    def step(self, prefill, decode):
        if prefill or decode:
            self.prompts_by_step.append({c.seq_id for c in prefill})
            self.step_started.set()
        return super().step(prefill, decode)


def _generate_in_background(stub, prompt, max_new_tokens, results: dict, key: str):
    def run() -> None:
        results[key] = generate(stub, prompt, max_new_tokens)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_prompt_sent_during_a_long_step_starts_in_the_next_step(scheduler, stub):
    engine = StepRecorder(step_seconds=STEP_SECONDS)
    worker = WorkerThread(scheduler.port, "w0", engine, session=True, overlap=True).start()
    wait_until(lambda: len(stub.GetStatus(pb.GetStatusRequest()).workers) == 1, "the worker", 30)
    results: dict = {}
    long_prompt, short_prompt = [5, 6, 7], [8, 9]
    first = _generate_in_background(stub, long_prompt, 12, results, "first")
    # A few decode steps: the worker learns how long a step takes and an answer.
    wait_until(lambda: len(engine.prompts_by_step) >= 4, "four steps", 30)
    engine.step_started.clear()
    assert engine.step_started.wait(10)
    in_flight = len(engine.prompts_by_step) - 1
    reply = stub.Submit(pb.SubmitRequest(prompt_token_ids=short_prompt, max_new_tokens=2))
    second_id = reply.seq_id
    first.join(30)
    wait_until(lambda: any(second_id in p for p in engine.prompts_by_step), "the second prompt", 30)
    started_in = next(i for i, p in enumerate(engine.prompts_by_step) if second_id in p)
    worker.stop.set()
    worker.join()
    assert results["first"][1] == reference_output(long_prompt, 12)
    # Submitted while step `in_flight` ran (a step of 0.3 s, submitted as it started):
    # the decision for the step after was asked near its end, after the submission.
    assert started_in == in_flight + 1, engine.prompts_by_step


@pytest.mark.parametrize("scheduler", [{}], indirect=True)
def test_a_worker_that_asks_later_gets_every_token_once(scheduler, stub):
    # Several prompts, sent while long steps run: each stream equals sequential generation.
    engine = StepRecorder(step_seconds=0.1)
    worker = WorkerThread(scheduler.port, "w0", engine, session=True, overlap=True).start()
    wait_until(lambda: len(stub.GetStatus(pb.GetStatusRequest()).workers) == 1, "the worker", 30)
    prompts = [[i, i + 1, i + 2] for i in range(1, 7)]
    results: dict = {}
    threads = []
    for i, prompt in enumerate(prompts):
        threads.append(_generate_in_background(stub, prompt, 6, results, str(i)))
        engine.step_started.clear()
        engine.step_started.wait(5)
    for t in threads:
        t.join(30)
    worker.stop.set()
    worker.join()
    for i, prompt in enumerate(prompts):
        assert results[str(i)][1] == reference_output(prompt, 6)


def test_a_report_asking_to_be_decided_later_is_never_parked_as_a_long_poll(scheduler, stub):
    # A worker that holds nothing and asks both for a long poll and to be decided later:
    # each wake-up of a parked call would be deferred again, so the call returns at once.
    reg = stub.RegisterWorker(convert.register_request(WorkerResources("w9", 4096, 16, 8)))
    assert reg.accepts_decide_later
    request = pb.SelectBatchRequest(
        worker_id="w9",
        incarnation=reg.incarnation,
        kv_free_pages=4000,
        gdn_free_slots=8,
        idle_wait_ms=5000,
        decide_later=True,
    )
    answered = threading.Event()

    def ask() -> None:
        stub.SelectBatch(request, timeout=10)
        answered.set()

    threading.Thread(target=ask, daemon=True).start()
    assert answered.wait(2.0), "a decide_later report was parked for its long poll"


def test_a_single_scheduler_holds_no_answer_until_it_is_due(scheduler, stub):
    # Its answers wait on no commit: its workers send no answer_due_us (docs/contract.md,
    # "Answers due later") and time every round trip, as before.
    reg = stub.RegisterWorker(convert.register_request(WorkerResources("w8", 4096, 16, 8)))
    assert not reg.accepts_answer_due
