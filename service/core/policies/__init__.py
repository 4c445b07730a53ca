"""The policies: `fifo` (the seed's), `budget` and `fair` (contract, "Policies")."""
from __future__ import annotations

from service.core.config import SchedulerConfig
from service.core.policies.budget import BudgetPolicy, FairPolicy
from service.core.policies.fifo import FifoPolicy
from service.core.plan import Policy

__all__ = ["BudgetPolicy", "FairPolicy", "FifoPolicy", "make_policy"]

_POLICIES = {"fifo": FifoPolicy, "budget": BudgetPolicy, "fair": FairPolicy}


def make_policy(config: SchedulerConfig) -> Policy:
    """The policy named by config.policy (validated beforehand)."""
    try:
        return _POLICIES[config.policy](config)
    except KeyError:
        raise ValueError(f"unknown policy {config.policy!r}") from None
