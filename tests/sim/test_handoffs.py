"""The simulator's prefill/decode split (service/sim/transfer.py): roles, handoffs and
their transfer model."""

from __future__ import annotations

import pytest

from service.cli.main import main
from service.core import FinishReason, SchedulerConfig
from service.sim.simulator import RunSpec, Simulation, WorkerShape
from service.sim.transfer import MODEL_SHAPES, Roles, TransferModel
from service.sim.workload import Request
from tests.sim.factories import LinearCost

SHAPE = WorkerShape(total_kv_pages=4000, page_size=4, total_gdn_slots=16)


def workload(n: int = 24) -> list[Request]:
    """Every third request a long prompt, the rest short, arriving while others decode."""
    return [Request(i, 0.05 * i, 2000 if i % 3 == 0 else 40, 30 + (i % 4)) for i in range(n)]


def run(roles: Roles | None, requests: list[Request], workers: int = 3):
    config = SchedulerConfig(policy="budget")
    spec = RunSpec(config, SHAPE, workers, roles=roles)
    return Simulation(spec, LinearCost(), requests).run()


def test_every_token_arrives_once_across_a_handoff():
    requests = workload()
    outcome = run(Roles(1, 2), requests)
    for record in outcome.records:
        assert record.finish_reason is FinishReason.MAX_LENGTH
        assert record.num_finishes == 1
        assert record.num_tokens == record.request.output_len  # none lost, none twice
    counts = outcome.handoffs
    assert counts.num_handoffs > 0
    assert counts.num_handoffs + counts.num_colocated == len(requests)
    assert counts.reasons.get("short_prompt") == 16  # the short ones stay co-located
    assert counts.num_bytes == counts.num_handoffs * MODEL_SHAPES["qwen3-next-80b"].handoff_bytes(
        2001
    )


def test_handed_off_prompts_are_computed_on_the_prefill_worker():
    outcome = run(Roles(1, 2), workload())
    handed = [r for r in outcome.records if r.request.prompt_len == 2000 and r.worker_id]
    # The latest admission of a handed-off request is on a decode worker, its first on
    # the prefill worker: its first token came before the transfer's end.
    assert outcome.handoffs.num_handoffs >= len(handed) // 2
    assert all(r.first_token_at < r.last_token_at for r in handed)


def test_without_roles_nothing_is_handed_off():
    assert run(None, workload()).handoffs is None


def test_a_slower_link_takes_longer_per_handoff():
    fast = TransferModel(bytes_per_second=12.5e9)
    slow = TransferModel(bytes_per_second=1.25e9)
    num_bytes = MODEL_SHAPES["qwen3-next-80b"].handoff_bytes(8001)
    assert slow.seconds(num_bytes) > 9 * (fast.seconds(num_bytes) - 0.001)


@pytest.mark.parametrize(
    "text, problem",
    [("2P", "NPMD"), ("0P3D", "at least one"), ("1P1D", "--workers is 3"), ("x", "NPMD")],
)
def test_roles_are_checked(text, problem):
    with pytest.raises(ValueError, match=problem):
        Roles.parse(text, 3)


def test_roles_parse_and_the_search_tries_fewer_prefill_than_decode_workers():
    assert Roles.parse("2p6d", 8) == Roles(2, 6)
    assert [r.name for r in Roles.splits(8)] == ["1P7D", "2P6D", "3P5D"]


def test_roles_need_pull_routing():
    with pytest.raises(ValueError, match="pull"):
        RunSpec(SchedulerConfig(), SHAPE, 3, routing="round-robin", roles=Roles(1, 2))


def test_the_cli_runs_a_split_and_prints_handoff_sizes(capsys):
    flags = ["simulate", "--trace", "sharegpt", "--num-requests", "30", "--workers", "3"]
    assert main([*flags, "--no-progress", "--qps", "4", "--roles", "1P2D"]) == 0
    out = capsys.readouterr().out
    assert "qwen3-next-80b-attention MB" in out and "1P2D: HandoffCounts(" in out


def test_the_cli_refuses_a_search_without_capacity(capsys):
    flags = ["simulate", "--trace", "sharegpt", "--workers", "3", "--qps", "1"]
    assert main([*flags, "--roles", "search"]) == 2
    assert "--roles search needs --find-capacity" in capsys.readouterr().err
