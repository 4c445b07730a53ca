"""Prefill/decode disaggregation in a SelectBatch (docs/contract.md, "Prefill/decode
disaggregation"; docs/disaggregation.md): which prompts a worker of a role admits, the
handoffs a decision starts, the receivers' results applied, and the failure rules of
workers leaving and deadlines passing.

The decision rule's parts (service/core/decide/handoff.py) choose; the handoff book
(service/core/tables/handoffs.py) keeps the states; this class applies them to the core's
tables. A fleet in which every worker is `BOTH` passes through here untouched: no filter,
no handoff, nothing booked.

A handoff here: a prefill-only worker's sequence, once its first token is reported, is
booked to the decode-capable worker with the fewest sequences that has room
(`pick_decode_worker`); the sender's decision carries a SEND (the sequence is decoded no
more there, but stays the sender's), the receiver's next decision a RECEIVE. DONE moves
the sequence to the receiver, whose token offsets go on from the sender's; the sender's
next report of it is answered with an evict. A failed handoff leaves the sequence with
its sender when the sender still holds it (it decodes it from then on: one attempt per
admission), otherwise the sequence is back in the queue already.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from service.core.decide.handoff import (
    HandoffInput,
    HandoffSettings,
    ModelShape,
    WorkerLoad,
    choose_handoff,
    pick_decode_worker,
)
from service.core.decide.policies.affinity import AffinityPrice
from service.core.learn.step_model import StepTimeModel
from service.core.tables.handoffs import (
    Handoff,
    HandoffAction,
    HandoffBook,
    HandoffOutcome,
    HandoffState,
)
from service.core.tables.ledger import WorkerRecord
from service.core.tables.sequences import Sequence
from service.core.tables.steady import SteadyStep
from service.core.tables.tables import Tables
from service.core.types import (
    Decision,
    HandoffDirection,
    HandoffInstruction,
    HandoffResult,
    HandoffStatus,
    WorkerRole,
)
from service.core.vocabulary import HandoffEnd

# How each failure the receiver reports ends its handoff (a metric label).
_FAILURE_END = {
    HandoffStatus.SENDER_UNREACHABLE: HandoffEnd.SENDER_UNREACHABLE,
    HandoffStatus.CHECKSUM_MISMATCH: HandoffEnd.CHECKSUM,
    HandoffStatus.NO_ROOM: HandoffEnd.RECEIVER_REFUSED,
    HandoffStatus.TIMED_OUT: HandoffEnd.TIMEOUT,
    HandoffStatus.UNKNOWN_SEQUENCE: HandoffEnd.RECEIVER_REFUSED,
}
# How many of a prefill-only worker's latest decisions keep their decode lists: the
# report names the one it applied, which is older than the latest only after lost answers.
_DECISIONS_KEPT = 3
# Prompts shorter than this (tokens to compute) stay with a decode worker: their prefill
# delays its decodes little (HandoffSettings.min_uncached_tokens' default).
DEFAULT_MIN_UNCACHED_TOKENS = 1024


@dataclass
class _Decodes:
    """A prefill-only worker's latest decode lists and what its reports named of the
    decision they applied (`WorkerReport.applied_iteration`)."""

    # The latest _DECISIONS_KEPT decisions by iteration: by seq_id, the tokens each
    # sequence of the decode list has once that step's token is reported (None: not known,
    # a token may have been in flight when it was decided). With overlap the next report
    # comes while the step runs, one token short of what the worker will hold.
    by_iteration: dict[int, dict[int, int | None]] = field(default_factory=dict)
    # Whether a report named a decision: one that names none tells nothing of it since.
    names_applied: bool = False
    # What it named before this scheduler decided anything for it (a decision of the
    # scheduler before a restart, whose numbers this one reuses): never trusted.
    foreign: int = 0


class Disaggregation:
    """Roles and handoffs over the core's tables, called from each SelectBatch and from
    the worker registry (a worker leaving, the lease sweep)."""

    def __init__(
        self,
        tables: Tables,
        steady: SteadyStep,
        timeout_seconds: float,
        started_at: float,
        min_uncached_tokens: int = DEFAULT_MIN_UNCACHED_TOKENS,
        priced: bool = False,
    ) -> None:
        """`timeout_seconds`: how long a receiver has to report an import;
        `started_at`: the wall clock now, in seconds (transfer ids start above any a
        scheduler started before this one handed out: 2**20 a millisecond); `priced`: ask
        the handoff rule where a sender registered its sizes (else the threshold alone)."""
        self._sequences = tables.sequences
        self._ledger = tables.ledger
        self._changes = tables.changes
        self._observer = tables.observer
        self._clock = tables.clock
        self._steady = steady
        self._timeout_seconds = timeout_seconds
        self._min_uncached_tokens = min_uncached_tokens
        self._priced = priced
        self._rule_settings = HandoffSettings(min_uncached_tokens=min_uncached_tokens)
        # A prompt's prefill time as the rule weighs it: the cautious default step model.
        self._price = AffinityPrice(StepTimeModel())
        self._book = HandoffBook(timeout_seconds)
        self._next_transfer_id = int(started_at * 1000) << 20
        # Per receiver, the (seq_id, transfer_id) whose RECEIVE its next decision carries.
        self._receives: dict[str, list[tuple[int, int]]] = {}
        # Per sender, sequences whose handoff failed while it held them, by seq_id with
        # their admission_order: decoded there to the end of that assignment.
        self._kept: dict[str, dict[int, int]] = {}
        # Per prefill-only worker, its latest decode lists and what its reports named.
        self._decoded: dict[str, _Decodes] = {}
        # Handoffs whose SEND booked a token still in flight on the sender: their RECEIVE
        # (its spec carries every token) waits until the sender reports that token.
        self._awaiting_token: set[int] = set()

    @property
    def book(self) -> HandoffBook:
        return self._book

    # ------------------------------------------------------------- admission

    def num_incoming(self, worker_id: str) -> int:
        """Sequences booked to `worker_id` by handoffs not yet imported: each will take one
        of its GDN slots, which its report still counts free."""
        return self._book.num_incoming(worker_id) if len(self._book) else 0

    def admits(
        self, worker: WorkerRecord, cached_tokens: Callable[[Sequence], int]
    ) -> Callable[[Sequence], bool] | None:
        """Which queued sequences `worker` may be given, by its role; None: any. A
        prefill-only worker leaves short prompts to the workers that decode; a
        decode-only one takes only prompts with few tokens to compute (the rule keeps
        them co-located), or any while no prefill-only worker takes prompts."""
        role = worker.registration.role
        if role is WorkerRole.BOTH:
            return None
        others = [w for w in self._ledger if w is not worker and w.admitting]
        minimum = self._min_uncached_tokens
        if role is WorkerRole.PREFILL:
            if not any(w.registration.role.decodes for w in others):
                return None
            rule = self._rule(worker, others)
            if rule is not None:
                return lambda seq: rule(seq, 0)
            return lambda seq: seq.num_tokens() >= minimum
        senders = [w for w in others if w.registration.role is WorkerRole.PREFILL]
        if not senders:
            return None
        rule = self._rule(senders[0], [worker, *others])
        if rule is not None:
            return lambda seq: not rule(seq, cached_tokens(seq))
        return lambda seq: seq.num_tokens() - cached_tokens(seq) < minimum

    def _rule(
        self, sender: WorkerRecord, fleet: list[WorkerRecord]
    ) -> Callable[[Sequence, int], bool] | None:
        """Whether a prompt (with its tokens cached where it would stay) is handed off,
        by choose_handoff: against the least busy decode-only worker of `fleet` and the
        slower of the two rates. None when `sender` registered no handoff sizes (the
        token threshold alone decides, as before sizes were known). Both sides ask the
        same question of the same fleet, so a prompt one refuses the other takes."""
        registration = sender.registration
        if not self._priced or registration.handoff_bytes_per_token <= 0:
            return None
        receivers = [w for w in fleet if w.registration.role is WorkerRole.DECODE]
        if not receivers:
            return None
        shape = ModelShape(
            attention_layers=1,
            kv_bytes_per_token=round(registration.handoff_bytes_per_token),
            gdn_layers=1,
            gdn_state_bytes=round(registration.handoff_fixed_bytes),
        )
        receiver = min(receivers, key=lambda w: (len(w.assigned), w.worker_id))
        rate = min(
            registration.transfer_bytes_per_second,
            receiver.registration.transfer_bytes_per_second,
        )
        settings, price = self._rule_settings, self._price

        def hands_off(seq: Sequence, cached: int) -> bool:
            num_tokens = seq.num_tokens()
            request = HandoffInput(
                prompt_tokens=num_tokens,
                cached_tokens=cached,
                prefill_seconds=price.prefill_seconds(num_tokens, cached),
                num_decoding=len(receiver.assigned),
                transfer_bytes_per_second=rate,
            )
            return choose_handoff(request, shape, settings).handoff

        return hands_off

    # ------------------------------------------------------------- reports

    def apply_results(self, worker: WorkerRecord, results: Iterable[HandoffResult]) -> list[int]:
        """Apply the results `worker` reports as a receiver; returns the ids to evict on
        it (results of handoffs not, or no longer, booked to it: rules 1 and 5)."""
        evict: list[int] = []
        for result in results:
            handoff = self._book.get(result.seq_id)
            if (
                handoff is None
                or handoff.transfer_id != result.transfer_id
                or handoff.receiver != worker.worker_id
                or handoff.state is not HandoffState.TRANSFERRING
            ):
                evict.append(result.seq_id)
                continue  # else a repeat of the DONE that made it this worker's: ignored
            sender = self._ledger.find(handoff.sender)
            seq = self._held(handoff, sender)
            holds = seq is not None
            seconds = result.transfer_us / 1e6
            if result.status is HandoffStatus.DONE and holds:
                self._awaiting_token.discard(result.seq_id)
                self._book.imported(result.seq_id, worker.worker_id)
                self._move(seq, sender, worker)
                self._observer.on_handoff(
                    seq.seq_id, sender.worker_id, worker.worker_id, HandoffEnd.DONE,
                    result.num_bytes, seconds,
                )  # fmt: skip
                continue
            end = _FAILURE_END.get(result.status, HandoffEnd.SENDER_GONE)
            outcome = self._book.failed(result.seq_id, end, holds)
            if outcome is not None:
                self._ended(outcome, result.num_bytes, seconds)
            if result.status is HandoffStatus.DONE:
                evict.append(result.seq_id)  # imported, but no longer the sender's to give
        # A sequence this worker now runs (a DONE of this report or an earlier one) is
        # never evicted, whichever stale result of it came first.
        return [s for s in dict.fromkeys(evict) if s not in worker.assigned]

    def worker_gone(self, worker_id: str) -> None:
        """`worker_id` left (deregistered, lease out, registered again): each handoff it
        sends or receives fails (failure rules 1 and 2); call after its sequences went
        back to the queue."""
        self._receives.pop(worker_id, None)
        self._kept.pop(worker_id, None)
        self._decoded.pop(worker_id, None)
        for outcome in self._book.worker_gone(worker_id):
            self._ended(outcome)

    def expire(self) -> None:
        """Transfers past their deadline fail; their senders decode them (rule 2)."""
        if len(self._book):
            for outcome in self._book.expire(self._clock()):
                self._ended(outcome)

    # ------------------------------------------------------------- decisions

    def decide(
        self,
        worker: WorkerRecord,
        decision: Decision,
        free_bytes: int,
        cached_tokens: Callable[[Sequence], int],
        applied_iteration: int = 0,
    ) -> Decision:
        """`decision` with this worker's handoffs: a prefill-only worker's decodes
        become SENDs where a receiver has room, and those it sends are decoded no more;
        the RECEIVEs booked to it are added while they fit in `free_bytes`
        (`cached_tokens`: its prefix cache's resume points, for each sequence;
        `applied_iteration`: the report's, the last decision the worker applied)."""
        handoffs: list[HandoffInstruction] = []
        decode = decision.decode
        if worker.registration.role is WorkerRole.PREFILL:
            decode = self._send(worker, decision, handoffs, applied_iteration)
        if worker.worker_id in self._receives:
            self._receive(worker, handoffs, free_bytes, cached_tokens)
        if not handoffs and decode is decision.decode:
            return decision
        return Decision(
            decision.prefill,
            decode,
            decision.evict,
            decision.iteration,
            decision.preempt,
            (*decision.handoffs, *handoffs),
        )

    def _send(
        self,
        worker: WorkerRecord,
        decision: Decision,
        handoffs: list[HandoffInstruction],
        applied_iteration: int,
    ) -> tuple[int, ...]:
        """Book a handoff for each of `worker`'s decodes that has a receiver; returns the
        decodes left to it. A SEND books the tokens the worker holds when it applies it:
        with a token still in flight (its step running computes the sequence's first
        token, or decodes it), that token too. A sequence whose token in flight is not
        known (the decision the worker applied is not) is left out one round, neither
        sent nor decoded, unless it stays here anyway. The SENDs still transferring are
        repeated (same transfer_id): an answer lost with its SEND is made good by the
        next one, and a worker that already offers the transfer ignores the repeat."""
        now = self._clock()
        for handoff in self._book.sent_by(worker.worker_id):
            seq = self._held(handoff, worker)
            if seq is None:  # finished, preempted, lost, cancelled
                self._awaiting_token.discard(handoff.seq_id)
                outcome = self._book.failed(handoff.seq_id, HandoffEnd.SENDER_GONE, False)
                if outcome is not None:
                    self._ended(outcome)
            elif handoff.state is HandoffState.TRANSFERRING:
                handoffs.append(self._send_instruction(handoff, now))
                if handoff.seq_id in self._awaiting_token and _has_every_token(seq, handoff):
                    self._awaiting_token.discard(handoff.seq_id)
                    self._observer.on_receive_ready(handoff.seq_id, handoff.receiver)
        decoded = self._applied_decodes(worker.worker_id, applied_iteration)
        kept = self._kept.get(worker.worker_id)
        if kept:
            for seq_id in [s for s in kept if s not in worker.assigned]:
                del kept[seq_id]
        address = worker.registration.handoff_address
        rate = worker.registration.transfer_bytes_per_second
        loads: list[WorkerLoad] | None = None
        # seq_id -> its tokens once this step's is reported (None: not known)
        decode: dict[int, int | None] = {}
        for seq_id in decision.decode:
            if self._book.get(seq_id) is not None:
                continue  # being sent: held for the receiver, not decoded
            seq = worker.assigned[seq_id]
            known = _in_flight(seq, decoded)
            # Where not known, counted in: a sequence that may be at its last token or
            # not fit a receiver is not sent.
            in_flight = 1 if known is None else known
            if (
                not address
                or rate <= 0
                or (kept and kept.get(seq_id) == seq.admission_order)
                # nothing left to decode after the tokens computed or in flight
                or len(seq.output_token_ids) + in_flight >= seq.params.max_new_tokens
            ):
                decode[seq_id] = None if known is None else seq.num_tokens() + in_flight + 1
                continue
            if loads is None:
                loads = self._receivers(worker)
            num_tokens = seq.num_tokens() + in_flight
            receiver = pick_decode_worker(
                (w for w in loads if self._ledger.get(w.worker_id).can_run(seq.adapter_id)),
                num_tokens,
            )
            if receiver is None:  # no room anywhere: it decodes here this step
                decode[seq_id] = None if known is None else num_tokens + 1
                continue
            if known is None:
                # A SEND could book a token more or fewer than the worker holds. Left out
                # of this decision, it is sent at the report that names the decision.
                continue
            handoffs.append(self._start(worker, seq, receiver.worker_id, in_flight))
            loads = [_one_more(w, num_tokens) if w is receiver else w for w in loads]
            loads = [w for w in loads if w.num_decoding < self._batch_limit(w.worker_id)]
        self._remember(worker.worker_id, decision.iteration, decode)
        return tuple(decode)

    def _applied_decodes(
        self, worker_id: str, applied_iteration: int
    ) -> dict[int, int | None] | None:
        """The decode list of the decision `worker_id` applied, as `_decoded` keeps it;
        None when not known: the report names a decision no longer kept, one numbered by
        a scheduler before this one (a restart), or none from a worker that named one
        before. A worker that never names one applied the latest decision (if its answer
        was lost, it did not: the contract's limit for such clients)."""
        book = self._decoded.setdefault(worker_id, _Decodes())
        decisions = book.by_iteration
        if applied_iteration:
            book.names_applied = True
            if not decisions:  # this scheduler decided nothing for it yet
                book.foreign = applied_iteration
                return None
            if applied_iteration == book.foreign:
                return None  # the same number this scheduler gave may name another decision
            book.foreign = 0  # it got a decision of this scheduler's since
            return decisions.get(applied_iteration)
        if book.names_applied:
            return None
        if not decisions:
            return {}
        return decisions[next(reversed(decisions))]

    def _remember(self, worker_id: str, iteration: int, decode: dict[int, int | None]) -> None:
        """Keep the decode list of `worker_id`'s decision `iteration`, and the latest few
        before it."""
        decisions = self._decoded[worker_id].by_iteration
        decisions[iteration] = decode
        while len(decisions) > _DECISIONS_KEPT:
            del decisions[next(iter(decisions))]

    def _receivers(self, sender: WorkerRecord) -> list[WorkerLoad]:
        """The workers a sequence of `sender` may be handed to, as the rule reads them.
        A receiver holds its assigned sequences and every handoff booked to it and not yet
        imported (its RECEIVE delivered or not: the import takes a GDN slot only when it
        lands, so a delivered one still counts)."""
        return [
            WorkerLoad(
                worker_id=w.worker_id,
                role=w.registration.role,
                num_decoding=held,
                free_kv_pages=w.kv_free_pages,
                page_size=w.registration.page_size,
                transfer_bytes_per_second=w.registration.transfer_bytes_per_second,
                draining=not w.admitting,
            )
            for w in self._ledger
            if w is not sender
            and w.registration.role is WorkerRole.DECODE
            and w.registration.transfer_bytes_per_second > 0
            and (held := len(w.assigned) + self.num_incoming(w.worker_id))
            < self._batch_limit(w.worker_id)
        ]

    def _batch_limit(self, worker_id: str) -> int:
        """The most sequences `worker_id` holds (a receiver takes no more): its batch, and
        its GDN slots, one per sequence (an import never preempts: a receiver with none
        free refuses it, NO_ROOM, and the sequence stays on its sender)."""
        worker = self._ledger.get(worker_id)
        slots = worker.registration.total_gdn_slots
        return (
            min(worker.settings.max_batch_size, slots)
            if slots > 0
            else worker.settings.max_batch_size
        )

    def _start(
        self, sender: WorkerRecord, seq: Sequence, receiver: str, in_flight: int
    ) -> HandoffInstruction:
        """Book the handoff of `seq` to `receiver`, counting the `in_flight` tokens (0 or
        1) the sender's running step adds before it applies the SEND."""
        transfer_id = self._next_transfer_id
        self._next_transfer_id += 1
        # The last token is fed by the receiver's first decode.
        num_tokens = seq.num_tokens() + in_flight - 1
        num_generated = len(seq.output_token_ids) + in_flight - seq.num_generated_at_admission
        now = self._clock()
        self._book.plan(seq.seq_id, sender.worker_id, receiver, transfer_id, seq.admission_order)
        self._book.prefilled(seq.seq_id, num_tokens, num_generated, now)
        self._receives.setdefault(receiver, []).append((seq.seq_id, transfer_id))
        if in_flight:
            self._awaiting_token.add(seq.seq_id)
        self._observer.on_handoff_started(seq.seq_id, sender.worker_id, receiver)
        return self._send_instruction(self._book.get(seq.seq_id), now)

    @staticmethod
    def _send_instruction(handoff: Handoff, now: float) -> HandoffInstruction:
        """The SEND of `handoff` (TRANSFERRING), its deadline what is left of it."""
        return HandoffInstruction(
            seq_id=handoff.seq_id,
            direction=HandoffDirection.SEND,
            transfer_id=handoff.transfer_id,
            peer_worker_id=handoff.receiver,
            num_tokens=handoff.num_tokens,
            num_generated=handoff.num_generated_at_transfer,
            deadline_ms=max(1, round((handoff.deadline - now) * 1000)),
        )

    def _receive(
        self,
        worker: WorkerRecord,
        handoffs: list[HandoffInstruction],
        free_bytes: int,
        cached: Callable[[Sequence], int],
    ) -> None:
        """The RECEIVEs booked to `worker` still in flight, while they fit; one whose
        sender has not yet reported every token it books waits (its spec would lack it)."""
        waiting = self._receives.pop(worker.worker_id)
        later: list[tuple[int, int]] = []  # the next decision's
        now = self._clock()
        for index, (seq_id, transfer_id) in enumerate(waiting):
            handoff = self._book.get(seq_id)
            sender = self._ledger.find(handoff.sender) if handoff is not None else None
            seq = self._held(handoff, sender) if sender is not None else None
            if seq is None or handoff.transfer_id != transfer_id:
                continue  # ended, or no longer the sender's to give, before it was delivered
            if not _has_every_token(seq, handoff):
                later.append((seq_id, transfer_id))
                continue
            spec = seq.spec()
            free_bytes -= seq.spec_wire_bytes()
            if free_bytes < 0 and handoffs:
                later += waiting[index:]
                break
            handoffs.append(
                HandoffInstruction(
                    seq_id=seq_id,
                    direction=HandoffDirection.RECEIVE,
                    transfer_id=transfer_id,
                    peer_worker_id=sender.worker_id,
                    num_tokens=handoff.num_tokens,
                    num_generated=handoff.num_generated_at_transfer,
                    deadline_ms=max(1, round((handoff.deadline - now) * 1000)),
                    peer_address=sender.registration.handoff_address,
                    spec=spec,
                    cached_tokens=min(cached(seq), handoff.num_tokens),
                )
            )
        if later:
            self._receives[worker.worker_id] = later

    # ------------------------------------------------------------- outcomes

    @staticmethod
    def _held(handoff: Handoff, sender: WorkerRecord | None) -> Sequence | None:
        """The sequence `handoff` moves, if `sender` still holds it in the assignment
        handed off (not finished, requeued or admitted anew since)."""
        seq = sender.assigned.get(handoff.seq_id) if sender is not None else None
        if seq is None or seq.admission_order != handoff.admission_order:
            return None
        return seq

    def _move(self, seq: Sequence, sender: WorkerRecord, receiver: WorkerRecord) -> None:
        """DONE: the sequence is the receiver's, in the same assignment (its offsets and
        finish counts go on from the sender's)."""
        del sender.assigned[seq.seq_id]
        receiver.assigned[seq.seq_id] = seq
        seq.worker_id = receiver.worker_id
        self._steady.forget(sender)
        self._steady.forget(receiver)
        self._changes.touched(seq)

    def _ended(self, outcome: HandoffOutcome, num_bytes: int = 0, seconds: float = 0.0) -> None:
        """A failed handoff's outcome: the sequence stays with a sender that holds it and
        is decoded there; a requeue was already made by what took it from the sender."""
        self._awaiting_token.discard(outcome.seq_id)
        sender = self._ledger.find(outcome.sender)
        seq = sender.assigned.get(outcome.seq_id) if sender is not None else None
        if outcome.action is HandoffAction.RESUME_ON_SENDER and seq is not None:
            self._kept.setdefault(outcome.sender, {})[seq.seq_id] = seq.admission_order
        self._observer.on_handoff(
            outcome.seq_id, outcome.sender, outcome.receiver, outcome.failure, num_bytes, seconds
        )


def _in_flight(seq: Sequence, decoded: dict[int, int | None] | None) -> int | None:
    """Whether the worker's step in flight computes a token of `seq` (1) or not (0), by
    `decoded`, the decode list of the decision it applied (None: not known): its last
    prompt chunk runs (the first token not reported), or that decision decoded it and the
    report lacks that token. None when it cannot be told."""
    if len(seq.output_token_ids) <= seq.num_generated_at_admission:
        return 1
    if decoded is None:
        return None
    expected = decoded.get(seq.seq_id, 0)
    if expected is None:
        return None
    return int(seq.num_tokens() < expected)


def _has_every_token(seq: Sequence, handoff: Handoff) -> bool:
    """Whether the scheduler has every token of `seq` that `handoff` moves (its
    `num_tokens`, and the last one, fed by the receiver's first decode)."""
    return seq.num_tokens() > handoff.num_tokens


def _one_more(load: WorkerLoad, num_tokens: int) -> WorkerLoad:
    """`load` with one more sequence of `num_tokens` booked to it."""
    pages = -(-(num_tokens + 1) // max(1, load.page_size))
    return WorkerLoad(
        load.worker_id,
        load.role,
        load.num_decoding + 1,
        max(0, load.free_kv_pages - pages),
        load.page_size,
        load.transfer_bytes_per_second,
        load.draining,
    )
