"""The handoff fault stack: `lattice-worker` processes on the tiny Qwen3.5 model with
roles (prefill, decode), on a `fault_stack.Stack`'s scheduler, and jobs whose expected
greedy tokens come from the reference engine run alone.

Used by tests/faults/test_handoff_kills.py and bench/handoff_kills.py. Needs torch.
"""

from __future__ import annotations

import random
import sys

from bench.harness.fault_stack import Job, Proc, Stack
from common.processes import free_port
from lattice.scheduler.v1 import scheduler_pb2 as pb

# Prompts this long always go to a prefill worker and are handed off.
PROMPT_TOKENS_RANGE = (1030, 1100)
NEW_TOKENS_RANGE = (16, 32)


def handoff_jobs(count: int, *, seed: int = 7, prefix: str = "handoff") -> list[Job]:
    """`count` jobs of long random prompts, each with the tokens the reference engine
    generates for it alone (greedy) and its finish reason (EOS or max length)."""
    jobs = handoff_prompts(count, seed=seed, prefix=prefix)
    set_expected(jobs)
    return jobs


def handoff_prompts(count: int, *, seed: int = 7, prefix: str = "handoff") -> list[Job]:
    """`count` jobs of long random prompts, their expected tokens not set yet (cheap: a
    long stream can be prepared, and only the jobs submitted given `set_expected`)."""
    rng = random.Random(seed)
    jobs = []
    for i in range(count):
        prompt = [rng.randrange(2, 500) for _ in range(rng.randint(*PROMPT_TOKENS_RANGE))]
        max_new_tokens = rng.randint(*NEW_TOKENS_RANGE)
        jobs.append(
            Job(f"{prefix}-{i}", prompt, max_new_tokens, [], [], pb.FINISH_REASON_UNSPECIFIED)
        )
    return jobs


def set_expected(jobs: list[Job]) -> None:
    """Set each job's expected tokens and finish reason from the reference engine run
    on it alone (greedy, CPU, float32)."""
    import torch

    from worker_client.engine.api import ChunkWork, SequenceSpec
    from worker_client.engine.engine import ModelEngine
    from worker_client.engine.loading import load_model

    model = load_model("tiny", device="cpu", dtype=torch.float32, seed=0)
    for job in jobs:
        engine = ModelEngine(
            model, total_kv_pages=80, page_size=16, total_gdn_slots=1, device="cpu"
        )
        spec = SequenceSpec(tuple(job.prompt), job.max_new_tokens)
        out = engine.step([ChunkWork(1, 0, len(job.prompt), spec)], [])
        tokens = [t for _, ids in out.tokens for t in ids]
        while engine.running_ids():
            tokens += [t for _, ids in engine.step([], [1]).tokens for t in ids]
        eos = tokens[-1] in model.config.eos_token_ids
        job.expected_tokens = tokens
        job.expected_reason = pb.FINISH_REASON_EOS if eos else pb.FINISH_REASON_MAX_LENGTH


def start_role_worker(stack: Stack, worker_id: str, role: str) -> None:
    """Start a `lattice-worker --role <role>` on the tiny model, with its own handoff
    channel, under `worker_id` (an id used before counts as a restart)."""
    if worker_id in stack.workers:
        stack.worker_restarts += 1
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
        role,
        "--transfer-gb-per-s",
        "1",
        "--handoff-port",
        str(free_port()),
    ]
    proc = Proc(f"{worker_id}.{number}", argv, stack.directory / f"{worker_id}.{number}.log")
    stack.all_procs.append(proc)
    stack.workers[worker_id] = proc


def handoff_counts(stack: Stack) -> dict[str, float]:
    """The scheduler's handoff counters: "started", and one entry per end label
    (lattice_scheduler_handoffs_total{end}: done, sender_gone, ...)."""
    counts = {"started": 0.0}
    for (name, labels), value in stack.metrics().items():
        if name == "lattice_scheduler_handoffs_started_total":
            counts["started"] = value
        elif name == "lattice_scheduler_handoffs_total":
            counts[dict(labels)["end"]] = value
    return counts


def handoffs_in_flight(counts: dict[str, float]) -> float:
    """Handoffs begun and not ended yet."""
    return counts["started"] - sum(v for k, v in counts.items() if k != "started")
