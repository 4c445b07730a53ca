"""A worker's own step limit (`max_step_tokens` at registration) bounds the budget
policies' token budget for it (docs/contract.md, "An engine's step limit")."""

from __future__ import annotations

from lattice.scheduler.v1 import scheduler_pb2 as pb
from service.server import convert
from worker_client.convert import register_request
from worker_client.resources import WorkerResources

from .factories import make_scheduler, register, report, submit


def _first_chunks(sched, num_prompts: int, prompt_len: int) -> list[int]:
    for _ in range(num_prompts):
        submit(sched, prompt_len=prompt_len, max_new_tokens=4)
    return [c.chunk_len for c in sched.select_batch(report(kv_free_pages=1000)).prefill]


def test_a_worker_step_limit_caps_a_configured_token_budget():
    sched = make_scheduler(policy="budget", max_num_batched_tokens=256, min_prefill_chunk=8)
    register(sched, max_step_tokens=100)
    assert _first_chunks(sched, 3, 60) == [60, 40]  # 100 tokens, not 256


def test_without_a_configured_budget_a_worker_gets_its_own_step_limit():
    sched = make_scheduler(policy="budget", max_seq_len=8192)
    register(sched, max_step_tokens=4096)
    # The default budget is 2,048 tokens; this worker's engine runs 4,096 a step.
    assert _first_chunks(sched, 2, 3000) == [3000, 1096]


def test_a_worker_without_a_step_limit_keeps_the_default_budget():
    sched = make_scheduler(policy="budget", max_seq_len=8192)
    register(sched)
    assert _first_chunks(sched, 2, 3000) == [2048]


def test_a_learned_budget_is_capped_by_the_worker_step_limit():
    # A TPOT target so loose that any step fits: the budget is the largest allowed.
    sched = make_scheduler(policy="budget", tpot_target_ms=1e9, max_seq_len=8192)
    register(sched, max_step_tokens=1000)
    # 1,000 rounded down to a multiple of 256, as every learned budget is; without the
    # limit, 16,384 tokens (all three prompts).
    assert sum(_first_chunks(sched, 3, 3000)) == 768


def test_the_step_limit_travels_from_worker_resources_to_the_registration():
    request = register_request(
        WorkerResources(
            "w", total_kv_pages=10, page_size=16, total_gdn_slots=2, max_step_tokens=2048
        )
    )
    assert request.max_step_tokens == 2048
    assert convert.worker_registration(request).max_step_tokens == 2048
    old = pb.RegisterWorkerRequest(
        worker_id="w", total_kv_pages=10, page_size=16, total_gdn_slots=2
    )
    assert convert.worker_registration(old).max_step_tokens == 0  # no limit of its own
