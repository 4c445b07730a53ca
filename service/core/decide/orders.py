"""Queue orders: which queued sequence a worker is offered first, chosen apart from
how a batch is filled (the policies, service/core/decide/policies/).

An order makes the in-memory queue (`new_queue`) and names its sort key as plain terms,
so that a store which keeps the queue itself claims in the same order without knowing
any policy (service/state/postgres.py turns the terms into SQL).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from service.core.config import SchedulerConfig
from service.core.registry import POLICIES, Order
from service.core.tables.fair_queue import DeadlineQueue, FairQueue
from service.core.tables.queue import AdmissionQueue, FcfsQueue


class SortTerm(enum.Enum):
    """One term of a queue order's sort key, ascending (earlier terms weigh more)."""

    QUEUE_KEY = "queue_key"  # FCFS key: the tail counts up, requeues count down
    # The priority, one better per aging_seconds waited since the first submission.
    AGED_PRIORITY = "aged_priority"
    TENANT_SERVICE = "tenant_service"  # the tenant's weighted tokens served so far
    SUBMITTED_AT = "submitted_at"  # the first submission (requeues keep it)
    # The TTFT deadline: the first submission plus --ttft-target-ms (one target for every
    # sequence, so deadlines sort as submissions do).
    DEADLINE = "deadline"
    SEQ_ID = "seq_id"


@dataclass(frozen=True)
class ArrivalOrder:
    """First come, first served; sequences back from a worker go to the head."""

    uses_tenant_service: ClassVar[bool] = False
    sort_key: ClassVar[tuple[SortTerm, ...]] = (SortTerm.QUEUE_KEY, SortTerm.SEQ_ID)
    aging_seconds: ClassVar[None] = None

    def new_queue(self) -> AdmissionQueue:
        return FcfsQueue()


@dataclass(frozen=True)
class FairOrder:
    """Priority bands with aging, tenants by least weighted service, first come first
    served inside a tenant (service/core/tables/fair_queue.py)."""

    aging_seconds: float
    # The tenants' service counters are kept (and saved) only for an order that reads them.
    uses_tenant_service: ClassVar[bool] = True
    sort_key: ClassVar[tuple[SortTerm, ...]] = (
        SortTerm.AGED_PRIORITY,
        SortTerm.TENANT_SERVICE,
        SortTerm.SUBMITTED_AT,
        SortTerm.SEQ_ID,
    )

    def new_queue(self) -> AdmissionQueue:
        return FairQueue(self.aging_seconds)


@dataclass(frozen=True)
class DeadlineOrder:
    """With a TTFT target (`budget`): priority bands with aging, earliest deadline
    (first submission + target) first inside a band. A sequence past its deadline keeps
    its place (it is late, not dropped); one back from a worker keeps its deadline.

    The fair queue with all tenants in one group (DeadlineQueue) is this order: with
    one target for all, deadlines sort as first submissions."""

    aging_seconds: float
    uses_tenant_service: ClassVar[bool] = False
    sort_key: ClassVar[tuple[SortTerm, ...]] = (
        SortTerm.AGED_PRIORITY,
        SortTerm.DEADLINE,
        SortTerm.SEQ_ID,
    )

    def new_queue(self) -> AdmissionQueue:
        return DeadlineQueue(self.aging_seconds)


QueueOrder = ArrivalOrder | FairOrder | DeadlineOrder


def queue_order(config: SchedulerConfig) -> QueueOrder:
    """The order config.policy's entry names (service/core/registry.py)."""
    order = POLICIES[config.policy].order
    if order is Order.FAIR:
        return FairOrder(config.aging_seconds)
    if order is Order.ARRIVAL_OR_DEADLINE and config.ttft_target_ms:
        return DeadlineOrder(config.aging_seconds)
    return ArrivalOrder()
