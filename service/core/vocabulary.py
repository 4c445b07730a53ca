"""The words policies and the mechanism share: why admissions stopped, why a sequence
was preempted, and what a policy may read of a sequence.

A leaf: it imports nothing of the core, so plan.py, step_budget.py, the policies and
the observer all read it without importing each other.
"""

from __future__ import annotations

import enum
from typing import Protocol


class BlockReason(enum.Enum):
    """What limited admissions to a worker in one decision (a bounded metric label)."""

    BATCH_FULL = "batch_full"
    KV_RESERVE = "kv_reserve"  # fifo's reserve guard; the budget policies' page check
    GDN_SLOTS = "gdn_slots"
    DRAINING = "draining"
    TOKEN_BUDGET = "token_budget"
    MESSAGE_SIZE = "message_size"
    # Candidates left for a worker better placed for them (their prefix is cached there,
    # or it is less loaded), for a bounded time (policies/placement.py).
    PLACEMENT = "placement"


class PlacementPass(enum.Enum):
    """Why a worker admitted a sequence whose longest cached prefix another worker holds
    (a bounded metric label; policies/placement.py): each a rule of the placement's."""

    OVERDUE = "overdue"  # queued for --aging-seconds: never deferred
    CHEAPER_HERE = "cheaper_here"  # the asker runs it sooner than the holder (often idle)
    HOLDER_AT_CAP = "holder_at_cap"  # the holder runs its share and a quarter already
    HOLDERS_BUSY = "holders_busy"  # every holder is at its share: placed by load
    WAITED_OUT = "waited_out"  # deferred for its patience; the holder did not take it


class HandoffEnd(enum.Enum):
    """How a handoff ended (a bounded metric label; docs/contract.md, "Prefill/decode
    disaggregation")."""

    DONE = "done"
    SENDER_GONE = "sender_gone"
    RECEIVER_GONE = "receiver_gone"
    # The receiver could not reach the sender's handoff channel (the sender may live on).
    SENDER_UNREACHABLE = "sender_unreachable"
    TIMEOUT = "timeout"
    CHECKSUM = "checksum"
    RECEIVER_REFUSED = "receiver_refused"  # no room, or the receiver could not import


class PreemptReason(enum.Enum):
    """Why a running sequence was preempted (a bounded metric label)."""

    KV_GROWTH = "kv_growth"  # the scheduler: this iteration's decodes need more pages
    NO_PROGRESS = "no_progress"  # the scheduler: prefills stuck on pages, nothing else ran
    WORKER = "worker"  # the worker evicted it on its own and reported it


class StepTimeRefusal(enum.Enum):
    """Why a worker's reported step time was not learned (a bounded metric label)."""

    # Longer than the time since its decision was answered: the step cannot have run so.
    LONGER_THAN_ELAPSED = "longer_than_elapsed"
    # Far shorter than the worker's cadence: its busy reports come much slower than that.
    SHORTER_THAN_CADENCE = "shorter_than_cadence"


class SequenceView(Protocol):
    """What a policy may read of a sequence (service.core.tables.sequences.Sequence)."""

    @property
    def seq_id(self) -> int: ...

    @property
    def priority(self) -> int: ...

    @property
    def tenant(self) -> str: ...

    @property
    def adapter_id(self) -> str: ...

    @property
    def cursor(self) -> int:
        """Prompt tokens of the current spec handed out so far."""

    @property
    def admission_order(self) -> int:
        """Larger: admitted later."""

    def spec_prompt_len(self) -> int:
        """Prompt length of its current assignment's spec."""

    def num_tokens(self) -> int:
        """Its prompt plus every token generated so far: the tokens of its current
        assignment while running, the prompt length of its next spec while queued."""

    def spec_wire_bytes(self) -> int:
        """Upper bound of the bytes its first chunk takes in a decision."""
