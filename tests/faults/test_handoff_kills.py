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

import random
import sys

import pytest

from bench.harness.fault_stack import Job, Proc, check
from common.processes import free_port
from common.waiting import wait_until
from lattice.scheduler.v1 import scheduler_pb2 as pb

torch = pytest.importorskip("torch")
from worker_client.engine.api import ChunkWork, SequenceSpec  # noqa: E402
from worker_client.engine.engine import ModelEngine  # noqa: E402
from worker_client.engine.loading import load_model  # noqa: E402

pytestmark = pytest.mark.slow

NUM_SEQUENCES = 10
ROLES = {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"}


def _jobs() -> list[Job]:
    model = load_model("tiny", device="cpu", dtype=torch.float32, seed=0)
    rng = random.Random(7)
    jobs = []
    for i in range(NUM_SEQUENCES):
        prompt = [rng.randrange(2, 500) for _ in range(rng.randint(1030, 1100))]
        max_new_tokens = rng.randint(16, 32)
        engine = ModelEngine(
            model, total_kv_pages=80, page_size=16, total_gdn_slots=1, device="cpu"
        )
        spec = SequenceSpec(tuple(prompt), max_new_tokens)
        out = engine.step([ChunkWork(1, 0, len(prompt), spec)], [])
        tokens = [t for _, ids in out.tokens for t in ids]
        while engine.running_ids():
            tokens += [t for _, ids in engine.step([], [1]).tokens for t in ids]
        eos = tokens[-1] in model.config.eos_token_ids
        reason = pb.FINISH_REASON_EOS if eos else pb.FINISH_REASON_MAX_LENGTH
        jobs.append(Job(f"handoff-{i}", prompt, max_new_tokens, [], tokens, reason))
    return jobs


def _start_worker(stack, worker_id: str) -> None:
    number = sum(p.name.startswith(worker_id + ".") for p in stack.all_procs)
    argv = [
        sys.executable,
        "-m",
        "worker_client",
        "--scheduler",
        stack.target,
        "--worker-id",
        worker_id,
        "--model",
        "tiny",
        "--kv-pages",
        "1024",
        "--page-size",
        "16",
        "--gdn-slots",
        "8",
        "--threads",
        "1",
        "--role",
        ROLES[worker_id],
        "--transfer-gb-per-s",
        "1",
        "--handoff-port",
        str(free_port()),
    ]
    proc = Proc(f"{worker_id}.{number}", argv, stack.directory / f"{worker_id}.{number}.log")
    stack.all_procs.append(proc)
    stack.workers[worker_id] = proc


def _handoffs_done(stack) -> float:
    return stack.metrics().get(("lattice_scheduler_handoffs_total", (("end", "done"),)), 0.0)


def test_killing_a_sender_then_a_receiver_mid_handoff_loses_nothing(make_stack, make_clients):
    jobs = _jobs()
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
    outcome = check(stack.stub, jobs)
    assert outcome.problems == [], "\n".join(outcome.problems[:20])
    assert outcome.acknowledged == len(jobs)
    assert (
        outcome.lost,
        outcome.duplicated_tokens,
        outcome.missing_tokens,
        outcome.wrong_outputs,
    ) == (0, 0, 0, 0)
    print(f"handoffs done: {_handoffs_done(stack):g}, worker kills: {stack.worker_kills}")
