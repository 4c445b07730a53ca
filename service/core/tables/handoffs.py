"""The handoffs in flight: a sequence prefilled on one worker (the sender) moving to
another (the receiver), and what happens to it when either fails (docs/disaggregation.md,
"Failure rules").

A handoff's states, in order: PREFILLING on the sender; TRANSFERRING once the sender
reported the prompt done and its first token; RUNNING on the receiver once the receiver
reported the import done. Any failure before RUNNING ends the handoff with an outcome:
resume from the sender's cache while the sender still holds the sequence, otherwise go
back to the queue and resume from the saved tokens (prompt + what was generated). After
RUNNING the receiver owns the sequence like any other; the book forgets it.

Tokens are never counted twice: the book keeps the number of tokens generated when the
handoff began, and the receiver's first tokens must start at that offset
(`receiver_offset_ok`); the scheduler keeps every token reported, so a requeued sequence
resumes after the last one it saved.

Mechanism only: the book reads no config and moves no sequence; its outcomes are applied
by the caller (service/core/tables/lifecycle.py's back_to_queue for a requeue).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from service.core.vocabulary import HandoffEnd


class HandoffState(enum.Enum):
    PREFILLING = "prefilling"  # the prompt runs on the sender
    TRANSFERRING = "transferring"  # pages and states on the way to the receiver
    RUNNING = "running"  # decoding on the receiver: the handoff is over


class HandoffAction(enum.Enum):
    """What the caller does with a failed handoff's sequence."""

    REQUEUE = "requeue"  # back to the queue: resume from the saved tokens (recompute)
    RESUME_ON_SENDER = "resume_on_sender"  # the sender still holds it: decode it there


@dataclass(frozen=True, slots=True)
class HandoffOutcome:
    seq_id: int
    action: HandoffAction
    failure: HandoffEnd  # never DONE
    sender: str
    receiver: str


@dataclass(slots=True)
class Handoff:
    """One handoff in flight (mutable; owned by HandoffBook)."""

    seq_id: int
    sender: str
    receiver: str
    state: HandoffState
    # Tokens generated when the transfer began: the receiver's first token is this one.
    num_generated_at_transfer: int = 0
    # Prompt + generated tokens whose KV the receiver imports.
    num_tokens: int = 0
    # Scheduler clock by which the receiver must report the import (TRANSFERRING).
    deadline: float = 0.0
    # The attempt's id on the wire (Handoff.transfer_id): unique per attempt.
    transfer_id: int = 0
    # The sequence's admission to the sender that is handed off (Sequence.admission_order):
    # a sequence requeued and admitted again is another assignment, not this handoff's.
    admission_order: int = 0


class HandoffBook:
    """The handoffs in flight, by seq_id; the transitions and their failure rules."""

    def __init__(self, timeout_seconds: float) -> None:
        if not timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be above 0, got {timeout_seconds}")
        self._timeout = timeout_seconds
        self._by_seq_id: dict[int, Handoff] = {}

    def __len__(self) -> int:
        return len(self._by_seq_id)

    def get(self, seq_id: int) -> Handoff | None:
        return self._by_seq_id.get(seq_id)

    def plan(
        self,
        seq_id: int,
        sender: str,
        receiver: str,
        transfer_id: int = 0,
        admission_order: int = 0,
    ) -> Handoff:
        """A sequence placed on `sender` for its prompt, to decode on `receiver`."""
        if seq_id in self._by_seq_id:
            raise ValueError(f"sequence {seq_id} is already being handed off")
        if sender == receiver:
            raise ValueError(f"a handoff needs two workers, got {sender!r} twice")
        handoff = Handoff(
            seq_id,
            sender,
            receiver,
            HandoffState.PREFILLING,
            transfer_id=transfer_id,
            admission_order=admission_order,
        )
        self._by_seq_id[seq_id] = handoff
        return handoff

    def prefilled(self, seq_id: int, num_tokens: int, num_generated: int, now: float) -> Handoff:
        """The sender reported the prompt done (`num_tokens` held, `num_generated` of
        them generated, the first token among them): the transfer starts."""
        handoff = self._expect(seq_id, HandoffState.PREFILLING)
        handoff.state = HandoffState.TRANSFERRING
        handoff.num_tokens = num_tokens
        handoff.num_generated_at_transfer = num_generated
        handoff.deadline = now + self._timeout
        return handoff

    def imported(self, seq_id: int, receiver: str) -> Handoff:
        """The receiver reported the import done: it runs the sequence from now on."""
        handoff = self._expect(seq_id, HandoffState.TRANSFERRING)
        if handoff.receiver != receiver:
            raise ValueError(
                f"sequence {seq_id} was handed to {handoff.receiver!r}, not {receiver!r}"
            )
        handoff.state = HandoffState.RUNNING
        del self._by_seq_id[seq_id]
        return handoff

    def receiver_offset_ok(self, handoff: Handoff, first_offset: int) -> bool:
        """Whether the receiver's first reported token starts where the sender's
        stopped: anything else would count a token twice or leave a gap."""
        return first_offset == handoff.num_generated_at_transfer

    def failed(self, seq_id: int, failure: HandoffEnd, sender_holds: bool) -> HandoffOutcome | None:
        """End `seq_id`'s handoff; None if none is in flight. `sender_holds`: the sender
        still holds the sequence's pages and states (it reported it in its last report)."""
        handoff = self._by_seq_id.pop(seq_id, None)
        if handoff is None:
            return None
        resume = sender_holds and failure is not HandoffEnd.SENDER_GONE
        action = HandoffAction.RESUME_ON_SENDER if resume else HandoffAction.REQUEUE
        return HandoffOutcome(seq_id, action, failure, handoff.sender, handoff.receiver)

    def worker_gone(self, worker_id: str) -> list[HandoffOutcome]:
        """A worker left (deregistered, lease ran out, registered again): every handoff
        it sends or receives fails. Its own sequences are requeued by the caller as any
        other; one it was to receive resumes on its sender while the sender holds it."""
        outcomes = []
        for handoff in list(self._by_seq_id.values()):
            if handoff.sender == worker_id:
                outcomes.append(self.failed(handoff.seq_id, HandoffEnd.SENDER_GONE, False))
            elif handoff.receiver == worker_id:
                holds = handoff.state is HandoffState.TRANSFERRING
                outcomes.append(self.failed(handoff.seq_id, HandoffEnd.RECEIVER_GONE, holds))
        return [o for o in outcomes if o is not None]

    def sent_by(self, worker_id: str) -> list[Handoff]:
        """The handoffs `worker_id` sends."""
        return [h for h in self._by_seq_id.values() if h.sender == worker_id]

    def num_incoming(self, worker_id: str) -> int:
        """The handoffs `worker_id` receives and has not yet reported imported."""
        return sum(
            h.receiver == worker_id and h.state is not HandoffState.RUNNING
            for h in self._by_seq_id.values()
        )

    def expire(self, now: float) -> list[HandoffOutcome]:
        """Transfers past their deadline fail (TIMEOUT); the sender still holds them."""
        late = [
            h.seq_id
            for h in self._by_seq_id.values()
            if h.state is HandoffState.TRANSFERRING and now > h.deadline
        ]
        outcomes = [self.failed(seq_id, HandoffEnd.TIMEOUT, True) for seq_id in late]
        return [o for o in outcomes if o is not None]

    def _expect(self, seq_id: int, state: HandoffState) -> Handoff:
        handoff = self._by_seq_id.get(seq_id)
        if handoff is None or handoff.state is not state:
            found = "none" if handoff is None else handoff.state.value
            raise ValueError(f"sequence {seq_id}: expected a handoff {state.value}, found {found}")
        return handoff
