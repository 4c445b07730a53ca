"""The worker's ends of prefill/decode handoffs (docs/contract.md, "Prefill/decode
disaggregation"), between the loop and the handoff channel.

- SEND: the engine's state of the sequence is exported (a copy, taken while no step runs)
  and offered under the transfer_id until the scheduler evicts the sequence; the loop
  decodes it no more (`holding_back`), but keeps it in its running list. A sequence held
  for a SEND that a later decision names in its decode list is the sender's again (the
  handoff failed): it is no longer served, and decodes (`reclaim`). A sender whose
  sequence has moved past the SEND's `num_tokens` (it decoded meanwhile) serves nothing:
  its state is no longer the one the receiver is told to run.
- RECEIVE: a background thread fetches and checks the transfer, so the decode steps of
  the other sequences go on meanwhile; the loop then imports it (`finish_ready`, with no
  step in flight) and reports one outcome per transfer_id in its next SelectBatch. A fetch
  that fails, or a fetch or import past the deadline, keeps nothing.

The loop calls every method from its own thread, never while the engine steps.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from worker_client.engine.api import (
    Engine,
    ImportProblem,
    ImportRefused,
    SequenceSpec,
    StateChunk,
    StateKind,
)
from worker_client.handoff_channel import Fetched, FetchFailed, FetchProblem, OfferBook

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HandoffOrder:
    """One `Handoff` of a decision, in the worker's terms."""

    seq_id: int
    send: bool  # True: this worker is the sender; False: the receiver
    transfer_id: int
    peer_worker_id: str
    peer_address: str = ""  # RECEIVE: the sender's handoff channel
    num_tokens: int = 0
    num_generated: int = 0  # the receiver's first token offset
    spec: SequenceSpec | None = None  # RECEIVE: the sequence to run once imported
    cached_tokens: int = 0  # RECEIVE: leading tokens from its own prefix cache
    deadline_seconds: float = 0.0  # RECEIVE: report within this (0: no deadline given)


class HandoffEnd(enum.Enum):
    """How a received handoff ended (the contract's HandoffStatus)."""

    DONE = "done"
    SENDER_UNREACHABLE = "sender_unreachable"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    NO_ROOM = "no_room"
    TIMED_OUT = "timed_out"
    UNKNOWN_SEQUENCE = "unknown_sequence"


@dataclass(frozen=True)
class HandoffOutcome:
    """What the receiver reports of one transfer, once."""

    seq_id: int
    transfer_id: int
    end: HandoffEnd
    num_generated: int = 0  # DONE: the offset of its first token here
    num_bytes: int = 0
    transfer_seconds: float = 0.0  # from the instruction to the import's end
    error_message: str = ""


# The receiver's own deadline when the scheduler gave none.
DEFAULT_DEADLINE_SECONDS = 30.0
# A RECEIVE may reach the receiver before the SEND reaches the sender (both go out in
# their workers' next decisions): a transfer the sender does not hold yet is asked for
# again for this long (within the deadline) before it is UNKNOWN_SEQUENCE.
UNKNOWN_GRACE_SECONDS = 2.0
_RETRY_SECONDS = 0.02

_FETCH_END = {
    FetchProblem.SENDER_UNREACHABLE: HandoffEnd.SENDER_UNREACHABLE,
    FetchProblem.CHECKSUM_MISMATCH: HandoffEnd.CHECKSUM_MISMATCH,
    FetchProblem.TIMED_OUT: HandoffEnd.TIMED_OUT,
    FetchProblem.UNKNOWN_SEQUENCE: HandoffEnd.UNKNOWN_SEQUENCE,
}
# Chunks that do not fit this engine's pools are a failed check of what arrived.
_IMPORT_END = {
    ImportProblem.NO_ROOM: HandoffEnd.NO_ROOM,
    ImportProblem.CACHE_MISS: HandoffEnd.NO_ROOM,
    ImportProblem.INVALID: HandoffEnd.NO_ROOM,
    ImportProblem.MALFORMED: HandoffEnd.CHECKSUM_MISMATCH,
}

# (order, seconds to the deadline) -> the checked transfer; raises FetchFailed.
Fetcher = Callable[[HandoffOrder, float], Fetched]


@dataclass
class _Receiving:
    order: HandoffOrder
    started: float
    deadline: float
    fetch: Future | None = None
    # Wall-clock times (time.time()) of the handoff's timeline, for its log line.
    times: dict[str, float] = field(default_factory=dict)


class HandoffAgent:
    """Both ends of this worker's handoffs over `engine`; `offers` is what its handoff
    server serves (None: it cannot send), `fetcher` how it fetches from a peer."""

    def __init__(
        self,
        engine: Engine,
        offers: OfferBook | None,
        fetcher: Fetcher,
        *,
        max_fetches: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine = engine
        self._offers = offers
        self._fetcher = fetcher
        self._clock = clock
        self._fetches = ThreadPoolExecutor(max_fetches, thread_name_prefix="handoff-fetch")
        self._sending: set[int] = set()
        # By seq_id, the transfer it was told to SEND at a token count it no longer holds:
        # the scheduler repeats that SEND, and the state (decoded no more) stays as it is.
        self._not_served: dict[int, int] = {}
        self._receiving: dict[int, _Receiving] = {}  # by transfer_id
        self._ready: list[HandoffOutcome] = []  # ended before a fetch started
        # Imported sequences not yet decoded here: their first decode ends the timeline.
        self._first_decode: dict[int, int] = {}  # seq_id -> transfer_id
        # RECEIVEs started when their decision arrived (`receive_early`): `start` skips them.
        self._started_early: set[int] = set()  # transfer_ids
        self.num_sent_offers = 0
        self.num_imported = 0

    @property
    def holding_back(self) -> frozenset[int]:
        """Sequences held for a peer: not to decode here."""
        return frozenset(self._sending)

    @property
    def busy(self) -> bool:
        """Whether a received handoff is not yet reported (its fetch under way, or ended
        and not yet imported): the loop then does not ask for a long poll."""
        return bool(self._receiving)

    def num_fetching(self) -> int:
        """Fetches still under way."""
        return sum(not r.fetch.done() for r in self._receiving.values())

    def start(self, orders: Iterable[HandoffOrder], decided_at: float = 0.0) -> None:
        """Apply a decision's handoffs; `decided_at`: when the decision arrived (wall
        clock), logged with the handoff's timeline."""
        for order in orders:
            if order.send:
                self._send(order, decided_at)
            elif order.transfer_id in self._started_early:
                self._started_early.discard(order.transfer_id)
            else:
                self._receive(order, decided_at)

    def receive_early(self, orders: Iterable[HandoffOrder], decided_at: float = 0.0) -> None:
        """Start the RECEIVEs among `orders` now, while a step may run: a fetch touches no
        engine state until it is imported (`finish_ready`, with no step in flight). The
        decision's `start` then applies its SENDs and skips these."""
        for order in orders:
            if not order.send:
                self._receive(order, decided_at)
                self._started_early.add(order.transfer_id)

    def wait_for_fetch(self, timeout_seconds: float) -> None:
        """Until a fetch under way ends, at most `timeout_seconds` (now if none runs)."""
        running = [r.fetch for r in self._receiving.values() if not r.fetch.done()]
        if running:
            wait(running, timeout_seconds, return_when=FIRST_COMPLETED)

    def _send(self, order: HandoffOrder, decided_at: float) -> None:
        if self._offers is None or not self._engine.can_hand_off:
            log.warning(
                "told to send sequence %d, but this worker serves no handoff channel "
                "(no --handoff-port) or its engine cannot export",
                order.seq_id,
            )
            return
        if order.seq_id in self._sending and self._offers.offers(order.transfer_id):
            return  # a repeat of the SEND it serves (the scheduler repeats it until DONE)
        if self._not_served.get(order.seq_id) == order.transfer_id:
            return  # a repeat of one it could not serve: refused and logged once
        chunks = self._engine.export_sequence(order.seq_id)
        if chunks is None:
            return  # not held (finished, preempted): the receiver hears UNKNOWN_SEQUENCE
        extent = kv_extent(chunks)
        if extent is not None and extent != order.num_tokens:
            log.warning(
                "told to send sequence %d at %d tokens, but it holds %d: not served (the "
                "receiver hears UNKNOWN_SEQUENCE and the sequence stays here)",
                order.seq_id,
                order.num_tokens,
                extent,
            )
            self._not_served[order.seq_id] = order.transfer_id
            return
        # A SEND with a new transfer_id replaces any older one of the sequence (a
        # scheduler restarted): only the new id is served, one host copy.
        self._offers.withdraw([order.seq_id])
        self._offers.offer(order.transfer_id, order.seq_id, chunks)
        self._sending.add(order.seq_id)
        self.num_sent_offers += 1
        log.info(
            "handoff offered",
            extra={
                "seq_id": order.seq_id,
                "transfer_id": order.transfer_id,
                "num_tokens": order.num_tokens,
                "decided_at": decided_at,
                "offered_at": time.time(),
            },
        )

    def _receive(self, order: HandoffOrder, decided_at: float) -> None:
        now = self._clock()
        seconds = order.deadline_seconds or DEFAULT_DEADLINE_SECONDS
        if order.spec is None or not self._engine.can_hand_off:
            self._ready.append(
                _failed(order, HandoffEnd.NO_ROOM, "this worker's engine cannot import", 0.0)
            )
            return
        receiving = _Receiving(order, now, now + seconds)
        receiving.times.update(decided_at=decided_at, received_at=time.time())
        receiving.fetch = self._fetches.submit(self._fetch, receiving)
        self._receiving[order.transfer_id] = receiving

    def reclaim(self, decode: Iterable[int]) -> None:
        """Sequences held for a SEND that the scheduler now asks to decode are this
        worker's again: serve them no more."""
        if self._not_served:
            for seq_id in self._not_served.keys() & set(decode):
                del self._not_served[seq_id]
        again = self._sending.intersection(decode)
        if again:
            self._sending -= again
            if self._offers is not None:
                self._offers.withdraw(again)

    def decoding(self, decode: Iterable[int]) -> None:
        """The step about to run decodes `decode`: an imported sequence's first decode
        here is logged (the end of its handoff's timeline)."""
        if not self._first_decode:
            return
        for seq_id in self._first_decode.keys() & set(decode):
            log.info(
                "handoff first decode",
                extra={
                    "seq_id": seq_id,
                    "transfer_id": self._first_decode.pop(seq_id),
                    "decode_at": time.time(),
                },
            )

    def _fetch(self, receiving: _Receiving) -> Fetched:
        """The fetcher's answer, asking again while the sender does not know the transfer
        yet (UNKNOWN_GRACE_SECONDS); on the fetch thread."""
        order, deadline = receiving.order, receiving.deadline
        receiving.times["fetch_started_at"] = time.time()
        give_up = min(deadline, self._clock() + UNKNOWN_GRACE_SECONDS)
        try:
            while True:
                try:
                    return self._fetcher(order, max(0.001, deadline - self._clock()))
                except FetchFailed as err:
                    if err.problem is not FetchProblem.UNKNOWN_SEQUENCE or self._clock() >= give_up:
                        raise
                time.sleep(_RETRY_SECONDS)
        finally:
            receiving.times["fetch_ended_at"] = time.time()

    def finish_ready(self) -> list[HandoffOutcome]:
        """Import every fetch that has ended; the outcomes to report (each once)."""
        outcomes, self._ready = self._ready, []
        for transfer_id, receiving in list(self._receiving.items()):
            if not receiving.fetch.done():
                continue
            del self._receiving[transfer_id]
            outcomes.append(self._import(receiving))
        return outcomes

    def _import(self, receiving: _Receiving) -> HandoffOutcome:
        order = receiving.order
        try:
            fetched = receiving.fetch.result()
        except FetchFailed as err:
            return _failed(order, _FETCH_END[err.problem], str(err), self._since(receiving))
        except Exception as err:  # noqa: BLE001 - any fetch error is the sender's end failing
            message = f"fetch from {order.peer_address} failed: {err}"
            return _failed(order, HandoffEnd.SENDER_UNREACHABLE, message, self._since(receiving))
        if self._clock() > receiving.deadline:
            message = "the transfer arrived after the deadline; dropped"
            return _failed(order, HandoffEnd.TIMED_OUT, message, self._since(receiving))
        try:
            self._engine.import_sequence(
                order.seq_id, order.spec, fetched.chunks, order.cached_tokens
            )
        except ImportRefused as err:
            return _failed(order, _IMPORT_END[err.problem], str(err), self._since(receiving))
        self.num_imported += 1
        self._first_decode[order.seq_id] = order.transfer_id
        log.info(
            "handoff imported",
            extra={
                "seq_id": order.seq_id,
                "transfer_id": order.transfer_id,
                "num_bytes": fetched.num_bytes,
                **receiving.times,
                "imported_at": time.time(),
            },
        )
        return HandoffOutcome(
            order.seq_id,
            order.transfer_id,
            HandoffEnd.DONE,
            num_generated=order.num_generated,
            num_bytes=fetched.num_bytes,
            transfer_seconds=self._since(receiving),
        )

    def dropped(self, seq_ids: Iterable[int]) -> None:
        """These sequences left the engine (evicted, preempted, finished): serve them no
        more. A receive of one under way is kept: an evict concerns the state the engine
        held (a stale transfer's import, say), not a newer transfer still fetched, and
        each receive ends with its own outcome (the scheduler evicts an unwanted DONE)."""
        gone = set(seq_ids)
        if not gone:
            return
        self._sending -= gone
        for seq_id in gone.intersection(self._first_decode):
            del self._first_decode[seq_id]
        for seq_id in gone.intersection(self._not_served):
            del self._not_served[seq_id]
        if self._offers is not None:
            self._offers.withdraw(gone)

    def reset(self) -> None:
        """The scheduler forgot this worker: nothing is served or fetched any more."""
        self.dropped(list(self._sending))
        self._receiving.clear()
        self._ready.clear()
        self._started_early.clear()

    def close(self) -> None:
        self.reset()
        self._fetches.shutdown(wait=False, cancel_futures=True)

    def _since(self, receiving: _Receiving) -> float:
        return self._clock() - receiving.started


def max_transfer_bytes(engine: Engine, order: HandoffOrder) -> int | None:
    """The chunk data a RECEIVE of `order` takes, by this engine's own handoff sizes (the
    sender runs the same model): KV of the positions past `cached_tokens`, and the GDN
    states. None when the engine registered no sizes (no bound)."""
    if engine.handoff_bytes_per_token <= 0:
        return None
    num_tokens = max(0, order.num_tokens - order.cached_tokens)
    return math.ceil(engine.handoff_bytes_per_token * num_tokens + engine.handoff_fixed_bytes)


def kv_extent(chunks: Iterable[StateChunk]) -> int | None:
    """The KV positions the chunks reach (None: no attention layer)."""
    ends = [c.first_token + c.num_tokens for c in chunks if c.kind is StateKind.ATTENTION_KV]
    return max(ends) if ends else None


def _failed(order: HandoffOrder, end: HandoffEnd, message: str, seconds: float) -> HandoffOutcome:
    log.warning("handoff of sequence %d failed: %s", order.seq_id, message)
    return HandoffOutcome(
        order.seq_id, order.transfer_id, end, transfer_seconds=seconds, error_message=message
    )
