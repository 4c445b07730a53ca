"""The batching policies: `fifo` (the seed's) and `budget`; the `fair` policy is
`budget` batching over the fair queue order (docs/contract.md, "Policies";
service/core/decide/orders.py)."""
from __future__ import annotations

from service.core.config import SchedulerConfig
from service.core.decide.policies.budget import BudgetPolicy
from service.core.decide.policies.fifo import FifoPolicy
from service.core.decide.plan import Policy

__all__ = ["BudgetPolicy", "FifoPolicy", "make_policy"]

_POLICIES = {"fifo": FifoPolicy, "budget": BudgetPolicy, "fair": BudgetPolicy}


def make_policy(config: SchedulerConfig) -> Policy:
    """The batching policy config.policy names (validated beforehand); its queue order
    is service.core.decide.orders.queue_order(config)."""
    try:
        return _POLICIES[config.policy](config)
    except KeyError:
        raise ValueError(f"unknown policy {config.policy!r}") from None
