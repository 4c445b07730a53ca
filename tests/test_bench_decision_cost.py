"""bench/decision_cost.py's workloads are what its figures say they are, without
valgrind: R sequences decode (one token each) every decision, none is admitted, 1,000
stay queued; the served cell's answer parses as a SchedulerDecision with the same decode
list. No instruction count is pinned (machines differ).

The nano-vllm cell runs too when NANO_VLLM_DIR names a checkout of
GeeeekExplorer/nano-vllm (none is in the repository: its code is not ours to ship).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench import decision_cost as bench
from lattice.scheduler.v1 import scheduler_pb2 as pb
from service.core import SequenceState


@pytest.fixture(autouse=True)
def _unfreeze():
    yield
    import gc

    gc.unfreeze()  # the workloads freeze what they built; the rest of the suite need not


@pytest.mark.parametrize(
    "served, packed",
    [(False, False), (True, False), (True, True)],
    ids=["core", "served", "packed"],
)
@pytest.mark.parametrize("running", [8, 32])
def test_each_decision_decodes_every_running_sequence_with_1000_queued(running, served, packed):
    workload = bench.CoreWorkload(running, served=served, packed=packed)
    assert len(workload.running) == running
    core = workload.core
    before = {s: core.get_sequence(s).generated_tokens for s in workload.running}
    for _ in range(5):
        workload.step()
        decision = workload.last_decision
        assert list(decision.decode) == list(workload.running)
        assert not decision.prefill and not decision.evict and not decision.preempt
        assert core.status().queue_depth == bench.QUEUED
        if served:
            answer = pb.SchedulerDecision.FromString(workload.last)
            assert list(answer.decode) == list(workload.running)
    workload.check()
    for seq_id in workload.running:
        info = core.get_sequence(seq_id)
        assert info.state == SequenceState.DECODING
        assert info.generated_tokens == before[seq_id] + 5  # one token per decision
    prompt_lens = sorted(core.get_sequence(s).prompt_len for s in workload.running)
    assert prompt_lens[0] >= bench.PROMPT_LEN and prompt_lens[-1] < bench.PROMPT_LEN + 16


@pytest.mark.parametrize("running", [8, 32])
def test_the_unchanged_cell_sends_no_running_list_and_gets_decode_all_running(running):
    workload = bench.CoreWorkload(running, served=True, unchanged=True)
    core = workload.core
    before = {s: core.get_sequence(s).generated_tokens for s in workload.running}
    for _ in range(5):
        workload.step()
        assert list(workload.last_decision.decode) == list(workload.running)
        request = pb.SelectBatchRequest.FromString(workload.request_bytes)
        assert not request.running and request.running_unchanged_since
        answer = pb.SchedulerDecision.FromString(workload.last)
        assert answer.decode_all_running and not answer.decode and not answer.running_needed
    workload.check()
    assert all(core.get_sequence(s).generated_tokens == before[s] + 5 for s in workload.running)


def test_the_queued_prompts_are_512_tokens_and_distinct():
    import random

    rnd = random.Random(1)
    prompts = [bench._prompt(rnd, bench.PROMPT_LEN) for _ in range(50)]
    assert all(len(p) == 512 and all(1 <= t <= 150_000 for t in p) for p in prompts)
    assert len({tuple(p[:16]) for p in prompts}) == 50  # no shared first page


def test_the_check_refuses_a_decision_that_admits():
    workload = bench.CoreWorkload(8, served=False)
    workload.running = workload.running[:-1]  # as if one were not running
    with pytest.raises(SystemExit, match="set-up is wrong"):
        workload.check()


@pytest.mark.skipif(
    not os.environ.get("NANO_VLLM_DIR"), reason="NANO_VLLM_DIR (a nano-vllm checkout) not set"
)
@pytest.mark.parametrize("running", [8, 32])
def test_the_nano_cell_decodes_every_running_sequence(running):
    workload = bench.NanoWorkload(running, Path(os.environ["NANO_VLLM_DIR"]))
    lengths = [len(s) for s in workload.scheduler.running]
    for _ in range(5):
        workload.step()
        assert workload.last == (running, False)
    workload.check()
    assert [len(s) for s in workload.scheduler.running] == [n + 5 for n in lengths]
    assert len(workload.queued) == bench.QUEUED
    assert all(len(s) == bench.PROMPT_LEN for s in workload.queued)
