"""Admission policies: they set the budgets, the queue and the ledger carry them out."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from service.core.config import SchedulerConfig


class BlockReason(enum.Enum):
    """What limited admissions to a worker in one decision (a bounded metric label)."""

    BATCH_FULL = "batch_full"
    KV_RESERVE = "kv_reserve"
    GDN_SLOTS = "gdn_slots"
    DRAINING = "draining"


@dataclass(frozen=True)
class AdmissionBudget:
    """How many new sequences one worker may take now, and which limit set that number."""

    max_new_seqs: int
    limited_by: BlockReason


class Policy(Protocol):
    """What the Scheduler asks of a policy, once per SelectBatch."""

    name: str

    def admission_budget(
        self, *, max_batch_size: int, num_active: int, kv_free_pages: int,
        gdn_free_slots: int, draining: bool,
    ) -> AdmissionBudget: ...

    def chunk_len(self, *, cursor: int, prompt_len: int) -> int: ...


class FifoPolicy:
    """The seed's FifoScheduler (ADR-048 phase 1) with GDN slots gating admissions.

    - capacity = max_batch_size - active, never below 0;
    - the free-page reserve guard blocks admissions unless the batch is empty;
    - each new sequence needs one free GDN slot;
    - prompt chunks of at most chunk_size tokens.
    """

    name = "fifo"

    def __init__(self, config: SchedulerConfig) -> None:
        self._chunk_size = config.chunk_size
        self._prefill_reserve_pages = config.prefill_reserve_pages

    def admission_budget(
        self, *, max_batch_size: int, num_active: int, kv_free_pages: int,
        gdn_free_slots: int, draining: bool,
    ) -> AdmissionBudget:
        if draining:
            return AdmissionBudget(0, BlockReason.DRAINING)
        capacity = max(0, max_batch_size - num_active)
        if capacity == 0:
            return AdmissionBudget(0, BlockReason.BATCH_FULL)
        # The reserve guard: never starve an empty batch, whatever the page count.
        if kv_free_pages < self._prefill_reserve_pages and num_active > 0:
            return AdmissionBudget(0, BlockReason.KV_RESERVE)
        if gdn_free_slots < capacity:
            return AdmissionBudget(gdn_free_slots, BlockReason.GDN_SLOTS)
        return AdmissionBudget(capacity, BlockReason.BATCH_FULL)

    def chunk_len(self, *, cursor: int, prompt_len: int) -> int:
        return max(0, min(self._chunk_size, prompt_len - cursor))


def make_policy(config: SchedulerConfig) -> Policy:
    """The policy named by config.policy (validated beforehand)."""
    if config.policy == "fifo":
        return FifoPolicy(config)
    raise ValueError(f"unknown policy {config.policy!r}")
