"""The policies, in one place: each name with how it fills a batch, which queued sequence
it offers first, and the help serve prints for it.

Read by the config (the names it accepts), by `decide.policies.make_policy` (the
batching), by `decide.orders.queue_order` (the order), by serve's --help and by
docs/policies.md. A new policy is one entry here, plus its batching class in
decide/policies/ if it fills a batch in a new way. Imports nothing of ours, so that
every part of the core may read it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Batching(enum.Enum):
    """How a batch is filled (a class in decide/policies/)."""

    FIFO = "fifo"  # FifoPolicy: queue order, a batch-size cap, no token budget
    BUDGET = "budget"  # BudgetPolicy: a token budget per step, scheduler-chosen preemption


class Order(enum.Enum):
    """Which queued sequence a worker is offered first (decide/orders.py)."""

    ARRIVAL = "arrival"  # first come, first served
    # Arrival order; with a TTFT target, priority bands by earliest deadline.
    ARRIVAL_OR_DEADLINE = "arrival_or_deadline"
    FAIR = "fair"  # priority bands with aging, tenants by least weighted service


@dataclass(frozen=True)
class PolicyEntry:
    """One policy a config may name."""

    name: str
    batching: Batching
    order: Order
    help: str  # one clause, as serve's --help lists it


POLICIES: dict[str, PolicyEntry] = {
    entry.name: entry
    for entry in (
        PolicyEntry("fifo", Batching.FIFO, Order.ARRIVAL, "the seed's"),
        PolicyEntry(
            "budget",
            Batching.BUDGET,
            Order.ARRIVAL_OR_DEADLINE,
            "a token budget per iteration, scheduler-chosen preemption",
        ),
        PolicyEntry(
            "fair",
            Batching.BUDGET,
            Order.FAIR,
            "budget, plus priority bands with aging and tenant fairness",
        ),
    )
}
DEFAULT_POLICY = "budget"


def policies_help() -> str:
    """The policies as serve's --help lists them: `a (what), b (what) or c (what)`."""
    parts = [f"{e.name} ({e.help})" for e in POLICIES.values()]
    return ", ".join(parts[:-1]) + " or " + parts[-1]
