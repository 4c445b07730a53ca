"""The batching policies: `fifo` (the seed's) and `budget`. Which policy name uses
which batching is service/core/registry.py's (`fair` is `budget` batching over the fair
queue order, docs/contract.md, "Policies")."""

from __future__ import annotations

from service.core.config import SchedulerConfig
from service.core.decide.plan import Policy
from service.core.decide.policies.budget import BudgetPolicy
from service.core.decide.policies.fifo import FifoPolicy
from service.core.registry import POLICIES, Batching

__all__ = ["BudgetPolicy", "FifoPolicy", "make_policy"]

_BATCHING = {Batching.FIFO: FifoPolicy, Batching.BUDGET: BudgetPolicy}


def make_policy(config: SchedulerConfig) -> Policy:
    """The batching policy config.policy names (validated beforehand); its queue order
    is service.core.decide.orders.queue_order(config)."""
    try:
        entry = POLICIES[config.policy]
    except KeyError:
        raise ValueError(f"unknown policy {config.policy!r}") from None
    return _BATCHING[entry.batching](config)
