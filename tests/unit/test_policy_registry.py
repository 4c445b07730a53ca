"""Every policy is named in one place (service/core/registry.py): the config, the
batching, the queue order, serve's --help and docs/policies.md read it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from service.core import SchedulerConfig
from service.core.config import DEFAULT_POLICY, POLICIES
from service.core.decide.orders import ArrivalOrder, DeadlineOrder, FairOrder, queue_order
from service.core.decide.policies import BudgetPolicy, FifoPolicy, make_policy
from service.core.registry import POLICIES as REGISTRY
from service.core.registry import Batching, Order
from service.settings import add_arguments

DOCS = Path(__file__).resolve().parents[2] / "docs" / "policies.md"


def test_the_config_accepts_exactly_the_registered_names():
    assert POLICIES == tuple(REGISTRY)
    assert DEFAULT_POLICY in REGISTRY
    assert SchedulerConfig().policy == DEFAULT_POLICY


def test_serves_help_lists_each_registered_policy_with_its_help_text():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    action = next(a for a in parser._actions if a.dest == "policy")
    for entry in REGISTRY.values():
        assert f"{entry.name} ({entry.help})" in action.help


@pytest.mark.parametrize("name", list(REGISTRY))
def test_each_policy_is_built_with_the_batching_and_order_its_entry_names(name):
    entry = REGISTRY[name]
    config = SchedulerConfig(policy=name)
    batching = {Batching.FIFO: FifoPolicy, Batching.BUDGET: BudgetPolicy}[entry.batching]
    assert type(make_policy(config)) is batching
    order = {
        Order.ARRIVAL: ArrivalOrder,
        Order.ARRIVAL_OR_DEADLINE: ArrivalOrder,
        Order.FAIR: FairOrder,
    }[entry.order]
    assert type(queue_order(config)) is order
    with_target = queue_order(SchedulerConfig(policy=name, ttft_target_ms=500.0))
    assert type(with_target) is (
        DeadlineOrder if entry.order is Order.ARRIVAL_OR_DEADLINE else order
    )


def test_the_policies_page_lists_every_registered_policy():
    text = DOCS.read_text()
    assert "service/core/registry.py" in text
    for name in REGISTRY:
        assert f"| `{name}` |" in text
