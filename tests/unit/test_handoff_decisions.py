"""Handoffs in SelectBatch (service/core/decide/disaggregation.py): a prompt prefilled on
a prefill-only worker is handed to a decode-only one, and every failure rule of
docs/contract.md, "Prefill/decode disaggregation", loses nothing and counts no token
twice."""

from __future__ import annotations

from dataclasses import replace

import pytest

from service.core import Scheduler, SequenceState, WorkerRole
from service.core.observer import SchedulerObserver
from service.core.persist.store import MemoryStore
from service.core.types import (
    HandoffDirection,
    HandoffResult,
    HandoffStatus,
    TokenUpdate,
)
from service.core.vocabulary import HandoffEnd

from .factories import FakeClock, admit, finished, make_config, register, report, submit

LONG = 1100  # past the 1,024 tokens under which a prompt stays with a decode worker
FIRST = 42  # the first token, computed on the prefill worker
LEASE_MS = 10_000


class Ends(SchedulerObserver):
    def __init__(self) -> None:
        self.ends: list[HandoffEnd] = []
        self.started: list[tuple[int, str, str]] = []

    def on_handoff(self, seq_id, sender, receiver, end, num_bytes, transfer_seconds) -> None:
        self.ends.append(end)

    def on_handoff_started(self, seq_id, sender, receiver) -> None:
        self.started.append((seq_id, sender, receiver))


def fleet(store=None, clock=None, observer=None, roles=("p0", "d0", "d1")):
    """1 prefill + 2 decode workers that have each reported once (free pages known)."""
    sched = Scheduler(
        make_config(chunk_size=2048, lease_ttl_ms=LEASE_MS),
        clock=clock or FakeClock(),
        observer=observer,
        store=store,
    )
    for worker_id in roles:
        role = WorkerRole.PREFILL if worker_id.startswith("p") else WorkerRole.DECODE
        register(
            sched,
            worker_id,
            role=role,
            transfer_bytes_per_second=1e9,
            handoff_address=f"{worker_id}:7000",
        )
        sched.select_batch(report(worker_id))
    return sched


def prefilled(sched: Scheduler, max_new_tokens: int = 8):
    """A long prompt admitted by p0 and reported done with its first token; returns its
    seq_id and p0's decision to that report."""
    seq_id = submit(sched, prompt_len=LONG, max_new_tokens=max_new_tokens)
    assert admit(sched, "d0") == ()  # a decode worker leaves a long prompt to p0
    assert admit(sched, "p0") == (seq_id,)
    decision = sched.select_batch(report("p0", running=[seq_id], tokens={seq_id: [FIRST]}))
    return seq_id, decision


def result(seq_id, transfer_id, status=HandoffStatus.DONE):
    return HandoffResult(seq_id, transfer_id, status, num_bytes=1000, transfer_us=2000)


def with_results(worker_report, *results, tokens=()):
    return replace(worker_report, handoffs=tuple(results), tokens=tuple(tokens))


def test_a_prefilled_sequence_is_sent_to_a_decode_worker_and_decodes_there_once():
    observer = Ends()
    sched = fleet(observer=observer)
    seq_id, decision = prefilled(sched)
    (send,) = decision.handoffs
    assert decision.decode == ()  # held for the receiver, decoded no more on p0
    assert send.direction is HandoffDirection.SEND and send.peer_worker_id == "d0"
    assert (send.num_tokens, send.num_generated) == (LONG, 1)
    assert observer.started == [(seq_id, "p0", "d0")]

    (receive,) = sched.select_batch(report("d0")).handoffs
    assert receive.direction is HandoffDirection.RECEIVE
    assert receive.transfer_id == send.transfer_id
    assert receive.peer_worker_id == "p0" and receive.peer_address == "p0:7000"
    assert tuple(receive.spec.prompt_token_ids) == (*range(1, LONG + 1), FIRST)
    assert receive.spec.max_new_tokens == 7
    assert (receive.num_tokens, receive.num_generated, receive.cached_tokens) == (LONG, 1, 0)
    assert receive.deadline_ms == LEASE_MS
    assert sched.select_batch(report("d0")).handoffs == ()  # delivered once

    again = sched.select_batch(report("p0", running=[seq_id]))
    # One handoff, still held: its SEND repeated (same transfer) while it transfers.
    assert again.decode == () and again.handoffs == (send,)

    done = sched.select_batch(
        with_results(report("d0", running=[seq_id]), result(seq_id, send.transfer_id))
    )
    assert done.decode == (seq_id,) and done.evict == ()
    assert sched.get_sequence(seq_id).worker_id == "d0"
    assert observer.ends == [HandoffEnd.DONE]
    assert sched.select_batch(report("p0", running=[seq_id])).evict == (seq_id,)

    # The receiver's offsets go on from the sender's: its first token is at offset 1.
    second = TokenUpdate(seq_id, (43,), offset=1)
    sched.select_batch(with_results(report("d0", running=[seq_id]), tokens=[second]))
    sched.select_batch(with_results(report("d0", running=[seq_id]), tokens=[second]))  # retried
    assert tuple(sched.read_output(seq_id, 0).token_ids) == (FIRST, 43)


def test_a_short_prompt_stays_on_the_decode_worker_that_admits_it():
    sched = fleet()
    seq_id = submit(sched, prompt_len=100)
    assert admit(sched, "p0") == ()  # the prefill worker leaves it to a decode worker
    assert admit(sched, "d0") == (seq_id,)
    decision = sched.select_batch(report("d0", running=[seq_id], tokens={seq_id: [FIRST]}))
    assert decision.decode == (seq_id,) and decision.handoffs == ()


def test_a_prefill_worker_with_no_decode_worker_beside_it_takes_every_prompt_and_decodes():
    sched = fleet(roles=("p0",))
    seq_id = submit(sched, prompt_len=100)
    assert admit(sched, "p0") == (seq_id,)
    decision = sched.select_batch(report("p0", running=[seq_id], tokens={seq_id: [FIRST]}))
    assert decision.decode == (seq_id,) and decision.handoffs == ()


def test_workers_of_role_both_never_see_a_handoff():
    sched = Scheduler(make_config(chunk_size=2048), clock=FakeClock())
    for worker_id in ("w0", "w1"):
        register(sched, worker_id, transfer_bytes_per_second=1e9, handoff_address="x:1")
        sched.select_batch(report(worker_id))
    seq_id = submit(sched, prompt_len=LONG)
    assert admit(sched, "w0") == (seq_id,)
    decision = sched.select_batch(report("w0", running=[seq_id], tokens={seq_id: [FIRST]}))
    assert decision.decode == (seq_id,) and decision.handoffs == ()
    assert sched.select_batch(report("w1")).handoffs == ()


def test_sender_gone_mid_transfer_requeues_from_the_saved_tokens_and_evicts_the_import():
    observer = Ends()
    sched = fleet(observer=observer)
    seq_id, decision = prefilled(sched)
    (send,) = decision.handoffs
    sched.select_batch(report("d0"))  # the RECEIVE
    assert sched.deregister_worker("p0") == 1
    assert observer.ends == [HandoffEnd.SENDER_GONE]
    assert sched.get_sequence(seq_id).state is SequenceState.QUEUED
    late = sched.select_batch(
        with_results(report("d0", running=[seq_id]), result(seq_id, send.transfer_id))
    )
    assert late.evict == (seq_id,) and late.prefill == ()
    (chunk,) = sched.select_batch(report("d1")).prefill  # no prefill worker left: d1 takes it
    assert tuple(chunk.spec.prompt_token_ids) == (*range(1, LONG + 1), FIRST)
    assert chunk.spec.max_new_tokens == 7


@pytest.mark.parametrize("how", ["deregistered", "registered_again"])
def test_receiver_gone_before_done_leaves_the_sequence_decoding_on_its_sender(how):
    observer = Ends()
    sched = fleet(observer=observer)
    seq_id, _ = prefilled(sched)
    sched.select_batch(report("d0"))
    if how == "deregistered":
        sched.deregister_worker("d0")
    else:
        register(sched, "d0", role=WorkerRole.DECODE, transfer_bytes_per_second=1e9)
    assert observer.ends == [HandoffEnd.RECEIVER_GONE]
    decision = sched.select_batch(report("p0", running=[seq_id]))
    assert decision.decode == (seq_id,) and decision.handoffs == ()  # no second attempt
    assert sched.get_sequence(seq_id).worker_id == "p0"


def test_receiver_gone_after_done_is_an_ordinary_requeue():
    sched = fleet()
    seq_id, decision = prefilled(sched)
    (send,) = decision.handoffs
    sched.select_batch(report("d0"))
    sched.select_batch(
        with_results(report("d0", running=[seq_id]), result(seq_id, send.transfer_id))
    )
    assert sched.deregister_worker("d0") == 1
    assert sched.get_sequence(seq_id).state is SequenceState.QUEUED
    assert sched.select_batch(report("p0", running=[seq_id])).evict == (seq_id,)


def test_a_transfer_past_its_deadline_fails_and_its_sender_decodes_it():
    clock, observer = FakeClock(), Ends()
    sched = fleet(clock=clock, observer=observer)
    seq_id, _ = prefilled(sched)
    sched.select_batch(report("d0"))
    for _ in range(2):  # both ends keep their leases; the import never comes
        clock.advance_ms(LEASE_MS * 0.6)
        sched.select_batch(report("d0"))
        sched.select_batch(report("d1"))
        decision = sched.select_batch(report("p0", running=[seq_id]))
    assert observer.ends == [HandoffEnd.TIMEOUT]
    assert decision.decode == (seq_id,)


@pytest.mark.parametrize(
    "status, end",
    [
        (HandoffStatus.CHECKSUM_MISMATCH, HandoffEnd.CHECKSUM),
        (HandoffStatus.NO_ROOM, HandoffEnd.RECEIVER_REFUSED),
        (HandoffStatus.SENDER_UNREACHABLE, HandoffEnd.SENDER_UNREACHABLE),
        (HandoffStatus.TIMED_OUT, HandoffEnd.TIMEOUT),
    ],
)
def test_a_failed_import_leaves_the_sequence_with_its_sender(status, end):
    observer = Ends()
    sched = fleet(observer=observer)
    seq_id, decision = prefilled(sched)
    (send,) = decision.handoffs
    sched.select_batch(report("d0"))
    failed = sched.select_batch(
        with_results(report("d0"), result(seq_id, send.transfer_id, status))
    )
    assert failed.decode == () and failed.evict == ()
    assert observer.ends == [end]
    assert sched.select_batch(report("p0", running=[seq_id])).decode == (seq_id,)
    # A DONE after the failure is for a handoff no longer booked: evicted.
    late = sched.select_batch(
        with_results(report("d0", running=[seq_id]), result(seq_id, send.transfer_id))
    )
    assert late.evict == (seq_id,) and sched.get_sequence(seq_id).worker_id == "p0"


def test_a_second_done_is_ignored():
    observer = Ends()
    sched = fleet(observer=observer)
    seq_id, decision = prefilled(sched)
    (send,) = decision.handoffs
    sched.select_batch(report("d0"))
    done = with_results(report("d0", running=[seq_id]), result(seq_id, send.transfer_id))
    sched.select_batch(done)
    again = sched.select_batch(done)
    assert again.evict == () and again.decode == (seq_id,)
    assert observer.ends == [HandoffEnd.DONE]


def test_a_result_for_an_unknown_transfer_is_answered_with_an_evict():
    sched = fleet()
    seq_id, decision = prefilled(sched)
    (send,) = decision.handoffs
    sched.select_batch(report("d0"))
    stray = sched.select_batch(with_results(report("d0"), result(seq_id, send.transfer_id + 1)))
    assert stray.evict == (seq_id,)
    wrong_worker = sched.select_batch(with_results(report("d1"), result(seq_id, send.transfer_id)))
    assert wrong_worker.evict == (seq_id,)
    # The real handoff is still in flight.
    sched.select_batch(
        with_results(report("d0", running=[seq_id]), result(seq_id, send.transfer_id))
    )
    assert sched.get_sequence(seq_id).worker_id == "d0"


def test_a_sequence_its_sender_finishes_mid_transfer_is_not_imported():
    sched = fleet()
    seq_id, decision = prefilled(sched)
    (send,) = decision.handoffs
    sched.select_batch(report("d0"))
    assert sched.cancel(seq_id)
    late = sched.select_batch(
        with_results(report("d0", running=[seq_id]), result(seq_id, send.transfer_id))
    )
    assert late.evict == (seq_id,)
    assert sched.get_sequence(seq_id).state is SequenceState.FINISHED


def test_a_sequence_cancelled_before_its_receive_is_delivered_is_not_sent():
    sched = fleet()
    seq_id, _ = prefilled(sched)
    assert sched.cancel(seq_id)
    assert sched.select_batch(report("d0")).handoffs == ()


def test_a_restart_fails_the_transfer_in_flight_and_the_sender_hands_off_anew():
    clock, store = FakeClock(), MemoryStore()
    sched = fleet(store=store, clock=clock)
    seq_id, decision = prefilled(sched)
    (send,) = decision.handoffs
    sched.select_batch(report("d0"))
    clock.advance_ms(1)
    restarted = Scheduler(
        make_config(chunk_size=2048, lease_ttl_ms=LEASE_MS),
        clock=clock,
        store=store,
        wall_clock=lambda: 2e9,  # later than the first scheduler's start
    )
    for worker_id in ("d0", "d1"):
        restarted.select_batch(report(worker_id))
    (again,) = restarted.select_batch(report("p0", running=[seq_id])).handoffs
    assert again.direction is HandoffDirection.SEND and again.transfer_id > send.transfer_id
    old = restarted.select_batch(
        with_results(report("d0", running=[seq_id]), result(seq_id, send.transfer_id))
    )
    assert old.evict == (seq_id,)
    assert restarted.get_sequence(seq_id).worker_id == "p0"
    assert tuple(restarted.read_output(seq_id, 0).token_ids) == (FIRST,)


def register_one_slot_receiver(sched, worker_id: str) -> None:
    """A decode worker with one GDN slot and 1,000 free KV pages, reported once."""
    register(
        sched,
        worker_id,
        role=WorkerRole.DECODE,
        transfer_bytes_per_second=1e9,
        handoff_address=f"{worker_id}:7000",
        total_kv_pages=1000,
        total_gdn_slots=1,
    )
    sched.select_batch(report(worker_id, kv_free_pages=1000))


def assert_two_of_three_handed_off(sched) -> None:
    """Three long prompts prefilled on p0: the first goes to d0, the second to d1, and
    the third, with no receiver left, decodes on p0."""
    first, second, third = (submit(sched, prompt_len=LONG) for _ in range(3))
    assert admit(sched, "p0") == (first, second, third)
    tokens = {seq_id: [FIRST] for seq_id in (first, second, third)}
    decision = sched.select_batch(report("p0", running=[first, second, third], tokens=tokens))
    assert [(h.seq_id, h.peer_worker_id) for h in decision.handoffs] == [
        (first, "d0"),
        (second, "d1"),
    ]
    assert decision.decode == (third,)


def test_a_full_receiver_is_passed_over_and_with_none_left_the_sender_decodes():
    sched = fleet()
    for worker_id in ("d0", "d1"):
        register(
            sched,
            worker_id,
            role=WorkerRole.DECODE,
            transfer_bytes_per_second=1e9,
            max_batch_size=1,
        )
        sched.select_batch(report(worker_id))
    assert_two_of_three_handed_off(sched)


def test_a_receiver_with_every_gdn_slot_taken_is_passed_over_like_a_full_batch():
    # An import never preempts: a receiver with no free GDN slot would refuse it (NO_ROOM)
    # and leave the sequence decoding on its sender, among its prompts' chunks.
    sched = fleet()
    for worker_id in ("d0", "d1"):
        register_one_slot_receiver(sched, worker_id)  # pages for all three
    assert_two_of_three_handed_off(sched)


def test_a_receive_delivered_but_not_imported_still_holds_the_receivers_gdn_slot():
    # Between its RECEIVE's delivery and its DONE the import is nowhere in the receiver's
    # assigned sequences, yet it will take the receiver's one GDN slot: a second handoff
    # booked there meanwhile would be refused (NO_ROOM) and decode on its sender.
    sched = fleet(roles=("p0",))
    register_one_slot_receiver(sched, "d0")
    first = submit(sched, prompt_len=LONG)
    assert admit(sched, "p0") == (first,)
    decision = sched.select_batch(report("p0", running=[first], tokens={first: [FIRST]}))
    assert [(h.seq_id, h.peer_worker_id) for h in decision.handoffs] == [(first, "d0")]
    (receive,) = sched.select_batch(report("d0", kv_free_pages=1000)).handoffs  # delivered
    assert receive.seq_id == first
    second = submit(sched, prompt_len=LONG)
    assert admit(sched, "p0", running=[first]) == (second,)
    decision = sched.select_batch(report("p0", running=[first, second], tokens={second: [FIRST]}))
    assert [h.seq_id for h in decision.handoffs if h.seq_id == second] == []
    assert second in decision.decode  # it decodes where it is, for now


def test_a_receiver_admits_no_prompt_into_the_gdn_slot_its_incoming_handoff_needs():
    sched = fleet(roles=("p0", "d0"))
    seq_id, decision = prefilled(sched)
    assert [(h.seq_id, h.peer_worker_id) for h in decision.handoffs] == [(seq_id, "d0")]
    short = submit(sched, prompt_len=16)
    # d0's one free slot is the import's: the short prompt waits for another.
    assert sched.select_batch(report("d0", gdn_free_slots=1)).prefill == ()
    assert admit(sched, "d0", gdn_free_slots=2) == (short,)  # one for each


def test_a_done_handoff_survives_a_restart_on_its_receiver():
    clock, store = FakeClock(), MemoryStore()
    sched = fleet(store=store, clock=clock)
    seq_id, decision = prefilled(sched)
    (send,) = decision.handoffs
    sched.select_batch(report("d0"))
    sched.select_batch(
        with_results(report("d0", running=[seq_id]), result(seq_id, send.transfer_id))
    )
    restarted = Scheduler(make_config(chunk_size=2048), clock=clock, store=store)
    assert restarted.get_sequence(seq_id).worker_id == "d0"
    assert restarted.select_batch(report("d0", running=[seq_id])).decode == (seq_id,)
    assert restarted.select_batch(report("p0", running=[seq_id])).evict == (seq_id,)


def test_a_prefill_worker_chunks_ignore_the_tpot_target():
    chunks = {}
    for role in (WorkerRole.BOTH, WorkerRole.PREFILL):
        sched = Scheduler(
            make_config(policy="budget", chunk_size=2048, tpot_target_ms=20), clock=FakeClock()
        )
        register(sched, "w0", role=role)
        seq_id = submit(sched, prompt_len=LONG)
        (chunk,) = sched.select_batch(report("w0")).prefill
        assert chunk.seq_id == seq_id
        chunks[role] = chunk.chunk_len
    assert chunks[WorkerRole.PREFILL] == LONG
    assert chunks[WorkerRole.BOTH] < LONG


def test_a_done_for_an_earlier_assignment_does_not_move_the_sequence_admitted_again():
    sched = fleet()
    seq_id, decision = prefilled(sched)
    (send,) = decision.handoffs
    sched.select_batch(report("d0"))
    # p0 lost it (its report leaves it out): requeued, and admitted to p0 again at once.
    assert admit(sched, "p0") == (seq_id,)
    late = sched.select_batch(
        with_results(report("d0", running=[seq_id]), result(seq_id, send.transfer_id))
    )
    assert late.evict == (seq_id,)
    info = sched.get_sequence(seq_id)
    assert (info.worker_id, info.state) == ("p0", SequenceState.PREFILLING)


def test_a_sequence_with_no_token_left_to_generate_is_not_handed_off():
    sched = fleet()
    seq_id, decision = prefilled(sched, max_new_tokens=1)  # its finish not reported yet
    assert decision.handoffs == () and decision.decode == (seq_id,)


def test_an_overlapping_prefill_worker_is_sent_its_sequence_with_the_first_token_in_flight():
    # With overlap the worker reports while the last prefill chunk runs, and applies the
    # decision once that step ends: the SEND books the first token that step computes,
    # so it is applied with no round lost; the RECEIVE, whose spec carries that token,
    # waits until the worker reports it.
    sched = fleet(roles=("p0", "d0"))
    seq_id = submit(sched, prompt_len=LONG)
    assert admit(sched, "p0") == (seq_id,)
    in_flight = sched.select_batch(report("p0", running=[seq_id]))
    (send,) = in_flight.handoffs
    assert in_flight.decode == ()
    assert (send.direction, send.peer_worker_id) == (HandoffDirection.SEND, "d0")
    assert (send.num_tokens, send.num_generated) == (LONG, 1)
    assert sched.select_batch(report("d0")).handoffs == ()  # its first token not known yet

    decision = sched.select_batch(report("p0", running=[seq_id], tokens={seq_id: [FIRST]}))
    assert decision.handoffs == (send,) and decision.decode == ()  # the SEND, repeated
    (receive,) = sched.select_batch(report("d0")).handoffs
    assert receive.direction is HandoffDirection.RECEIVE
    assert (receive.transfer_id, receive.num_tokens) == (send.transfer_id, LONG)
    assert receive.spec.prompt_token_ids[-1] == FIRST
    assert len(receive.spec.prompt_token_ids) == LONG + 1


def test_a_parked_receiver_is_woken_when_its_receive_gets_its_last_token():
    ends = Ends()
    woken: list[tuple[int, str]] = []
    ends.on_receive_ready = lambda seq_id, receiver: woken.append((seq_id, receiver))
    sched = fleet(observer=ends, roles=("p0", "d0"))
    seq_id = submit(sched, prompt_len=LONG)
    assert admit(sched, "p0") == (seq_id,)
    sched.select_batch(report("p0", running=[seq_id]))  # SEND booked, token in flight
    assert ends.started == [(seq_id, "p0", "d0")] and woken == []
    sched.select_batch(report("p0", running=[seq_id], tokens={seq_id: [FIRST]}))
    assert woken == [(seq_id, "d0")]


def test_an_overlapping_prefill_worker_with_no_receiver_room_decodes_with_its_first_token():
    sched = fleet(roles=("p0", "d0"))
    register(sched, "d0", role=WorkerRole.DECODE, transfer_bytes_per_second=1e9, max_batch_size=1)
    sched.select_batch(report("d0"))
    first, second = (submit(sched, prompt_len=LONG) for _ in range(2))
    assert admit(sched, "p0") == (first, second)
    in_flight = sched.select_batch(report("p0", running=[first, second]))
    # d0 has room for one: the first is sent, the second decodes on p0 (its first token,
    # in flight, is fed by that decode as after any prefill).
    assert [h.seq_id for h in in_flight.handoffs] == [first]
    assert in_flight.decode == (second,)


def test_handoff_min_tokens_sets_which_prompts_a_prefill_worker_takes():
    sched = Scheduler(make_config(chunk_size=2048, handoff_min_tokens=2000), clock=FakeClock())
    for worker_id, role in (("p0", WorkerRole.PREFILL), ("d0", WorkerRole.DECODE)):
        register(sched, worker_id, role=role, transfer_bytes_per_second=1e9, handoff_address="x:1")
        sched.select_batch(report(worker_id))
    seq_id = submit(sched, prompt_len=LONG)  # long by the default, short by this setting
    assert admit(sched, "p0") == ()
    assert admit(sched, "d0") == (seq_id,)


def sized_fleet(bytes_per_token: float, decoding: int, rule: str = "priced"):
    """p0 and d0 with handoff sizes registered (1 GB/s each); d0 decoding `decoding`
    short sequences; the scheduler's handoff_rule `rule`."""
    sched = Scheduler(make_config(chunk_size=2048, handoff_rule=rule), clock=FakeClock())
    for worker_id, role in (("p0", WorkerRole.PREFILL), ("d0", WorkerRole.DECODE)):
        register(
            sched,
            worker_id,
            role=role,
            transfer_bytes_per_second=1e9,
            handoff_address=f"{worker_id}:7000",
            handoff_bytes_per_token=bytes_per_token,
            handoff_fixed_bytes=1e5,
        )
        sched.select_batch(report(worker_id))
    short = [submit(sched, prompt_len=16) for _ in range(decoding)]
    assert admit(sched, "d0") == tuple(short)
    return sched, short


@pytest.mark.parametrize(
    ("bytes_per_token", "decoding", "prompt_len", "taker"),
    [
        (4096, 2, LONG, "p0"),  # pays: a small transfer beside the decodes it spares
        (4096, 2, 100, "d0"),  # short prompt
        (4096, 0, LONG, "d0"),  # idle decode worker: its prefill delays no one
        (1e6, 2, LONG, "d0"),  # slow transfer: 1.1 GB at 1 GB/s costs more than it saves
    ],
)
def test_with_handoff_sizes_the_rule_chooses_who_prefills(
    bytes_per_token, decoding, prompt_len, taker
):
    sched, short = sized_fleet(bytes_per_token, decoding)
    seq_id = submit(sched, prompt_len=prompt_len)
    held = {"p0": [], "d0": short}  # d0 still runs its short sequences
    other = "d0" if taker == "p0" else "p0"
    assert admit(sched, other, running=held[other]) == ()
    assert admit(sched, taker, running=held[taker]) == (seq_id,)


@pytest.mark.parametrize(("bytes_per_token", "decoding"), [(4096, 0), (1e6, 2)])
def test_the_default_threshold_rule_hands_off_every_long_prompt_despite_sizes(
    bytes_per_token, decoding
):
    # The cases the priced rule keeps on the decode worker (idle there; a slow
    # transfer): under the default rule the prefill worker takes them all the same.
    sched, short = sized_fleet(bytes_per_token, decoding, rule="threshold")
    seq_id = submit(sched, prompt_len=LONG)
    assert admit(sched, "d0", running=short) == ()
    assert admit(sched, "p0") == (seq_id,)


def _decoded_for_want_of_room(sched):
    """p0 prefilled two long prompts; d0 (room for one) took the first and finished it;
    the second decoded on p0 meanwhile. Returns the second's seq_id."""
    register(sched, "d0", role=WorkerRole.DECODE, transfer_bytes_per_second=1e9, max_batch_size=1)
    sched.select_batch(report("d0"))
    first, second = (submit(sched, prompt_len=LONG, max_new_tokens=50) for _ in range(2))
    assert admit(sched, "p0") == (first, second)
    tokens = {first: [FIRST], second: [FIRST]}
    decided = sched.select_batch(report("p0", running=[first, second], tokens=tokens))
    (send,) = decided.handoffs
    assert decided.decode == (second,)  # no room for it: decoded on p0
    # d0 imports `first` and finishes it: it has room again.
    sched.select_batch(report("d0"))
    sched.select_batch(with_results(report("d0", running=[first]), result(first, send.transfer_id)))
    sched.select_batch(report("d0", finished=[finished(first)], tokens={first: [7]}))
    return second


def test_a_send_on_an_overlapping_worker_books_the_decode_in_flight_and_loses_no_round():
    # With overlap, p0's report comes while the step of its last decision runs: the
    # sequence decoded there holds one token more when p0 applies the next decision. The
    # SEND books that token, so the sequence is sent at once (no round in which it is
    # neither decoded nor sent) and p0 serves exactly what the SEND books.
    sched = fleet(roles=("p0", "d0"))
    second = _decoded_for_want_of_room(sched)
    sent = sched.select_batch(report("p0", running=[second]))  # its decode in flight
    (send,) = sent.handoffs
    assert sent.decode == ()
    assert (send.seq_id, send.peer_worker_id) == (second, "d0")
    assert (send.num_tokens, send.num_generated) == (LONG + 1, 2)
    assert sched.select_batch(report("d0")).handoffs == ()  # that token is not known yet
    # p0's next report carries the token: d0 is told to fetch, the spec complete.
    again = sched.select_batch(report("p0", running=[second], tokens={second: [9]}))
    assert again.handoffs == (send,) and again.decode == ()
    (receive,) = sched.select_batch(report("d0")).handoffs
    assert receive.spec.prompt_token_ids[-2:] == (FIRST, 9)
    assert (receive.num_tokens, receive.num_generated) == (LONG + 1, 2)


def test_a_send_on_a_worker_that_reports_after_its_step_books_what_it_reported():
    # A worker that reports once its step ended (no overlap) has no token in flight: the
    # SEND books the tokens its report carries, and the RECEIVE goes out at once.
    sched = fleet(roles=("p0", "d0"))
    second = _decoded_for_want_of_room(sched)
    sent = sched.select_batch(report("p0", running=[second], tokens={second: [9]}))
    (send,) = sent.handoffs
    assert (send.num_tokens, send.num_generated) == (LONG + 1, 2)
    (receive,) = sched.select_batch(report("d0")).handoffs
    assert receive.spec.prompt_token_ids[-2:] == (FIRST, 9)


def test_a_sequence_that_ends_with_its_token_in_flight_is_never_received():
    # The token the SEND booked ended the sequence (a stop token): the handoff ends as the
    # sender's, and the receiver is never told to fetch it.
    ends = Ends()
    sched = fleet(observer=ends, roles=("p0", "d0"))
    seq_id = submit(sched, prompt_len=LONG)
    assert admit(sched, "p0") == (seq_id,)
    (send,) = sched.select_batch(report("p0", running=[seq_id])).handoffs
    sched.select_batch(report("p0", finished=[finished(seq_id)], tokens={seq_id: [FIRST]}))
    assert sched.select_batch(report("d0")).handoffs == ()
    assert ends.ends == [HandoffEnd.SENDER_GONE]
    assert sched.get_sequence(seq_id).state is SequenceState.FINISHED


def test_a_send_whose_answer_was_lost_is_repeated_until_the_transfer_ends():
    sched = fleet()
    seq_id, decision = prefilled(sched)  # p0 never gets this answer
    (send,) = decision.handoffs
    retried = sched.select_batch(report("p0", running=[seq_id], tokens={seq_id: [FIRST]}))
    assert retried.handoffs == (send,) and retried.decode == ()
    (receive,) = sched.select_batch(report("d0")).handoffs
    sched.select_batch(
        with_results(report("d0", running=[seq_id]), result(seq_id, send.transfer_id))
    )
    after = sched.select_batch(report("p0", running=[seq_id]))
    assert after.handoffs == () and after.evict == (seq_id,)


def test_a_stale_done_and_the_new_done_in_one_report_do_not_evict_the_sequence():
    # A restart leaves the receiver fetching the old transfer and the new one (its sender
    # serves both ids): it may report both DONEs at once, the old one first.
    clock, store = FakeClock(), MemoryStore()
    sched = fleet(store=store, clock=clock)
    seq_id, decision = prefilled(sched)
    (send,) = decision.handoffs
    sched.select_batch(report("d0"))  # RECEIVE (old) delivered to d0
    clock.advance_ms(1)
    restarted = Scheduler(
        make_config(chunk_size=2048, lease_ttl_ms=LEASE_MS),
        clock=clock,
        store=store,
        wall_clock=lambda: 2e9,
    )
    restarted.select_batch(report("d1", kv_free_pages=0))
    restarted.select_batch(report("d0"))
    (again,) = restarted.select_batch(report("p0", running=[seq_id])).handoffs
    assert again.peer_worker_id == "d0"
    restarted.select_batch(report("d0"))  # RECEIVE (new)
    both = restarted.select_batch(
        with_results(
            report("d0", running=[seq_id]),
            result(seq_id, send.transfer_id),
            result(seq_id, again.transfer_id),
        )
    )
    assert restarted.get_sequence(seq_id).worker_id == "d0"
    assert seq_id not in both.evict and seq_id in both.decode


def _in_turn(worker_report, applied_iteration, *tokens):
    """`worker_report` from a worker that names the decision it applied and reports
    `tokens` (TokenUpdates) by offset, so that sending it again adds none twice."""
    return replace(worker_report, tokens=tokens, applied_iteration=applied_iteration)


def test_a_report_sent_again_after_a_lost_answer_books_only_the_tokens_held():
    # p0 reports once its step ended (no overlap) and names the decision it applied. An
    # answer lost, it sends the same report again: no decode is in flight, so once d0 has
    # room the SEND books exactly what p0 holds and d0 is told to fetch at once.
    sched = fleet(roles=("p0", "d0"))
    register(sched, "d0", role=WorkerRole.DECODE, transfer_bytes_per_second=1e9, max_batch_size=1)
    sched.select_batch(report("d0"))
    first, second = (submit(sched, prompt_len=LONG, max_new_tokens=50) for _ in range(2))
    assert admit(sched, "p0") == (first, second)
    prefilled_both = [TokenUpdate(first, (FIRST,), 0), TokenUpdate(second, (FIRST,), 0)]
    decided = sched.select_batch(
        _in_turn(report("p0", running=[first, second]), 0, *prefilled_both)
    )
    (send,) = decided.handoffs
    assert decided.decode == (second,)  # no room for it on d0
    ran = _in_turn(
        report("p0", running=[first, second]), decided.iteration, TokenUpdate(second, (9,), 1)
    )
    assert sched.select_batch(ran).decode == (second,)  # this answer is lost
    retried = sched.select_batch(ran)
    assert retried.decode == (second,)
    # d0 imports `first` and finishes it: it has room again.
    sched.select_batch(report("d0"))
    sched.select_batch(with_results(report("d0", running=[first]), result(first, send.transfer_id)))
    sched.select_batch(report("d0", finished=[finished(first)], tokens={first: [7]}))
    # p0 ran the decode of `retried`: it holds the prompt, FIRST, 9 and 10.
    sent = sched.select_batch(
        _in_turn(report("p0", running=[second]), retried.iteration, TokenUpdate(second, (10,), 2))
    )
    (send,) = sent.handoffs
    assert (send.num_tokens, send.num_generated) == (LONG + 2, 3)
    (receive,) = sched.select_batch(report("d0")).handoffs
    assert receive.spec.prompt_token_ids[-3:] == (FIRST, 9, 10)


@pytest.mark.parametrize("named", ["none", "one no longer kept"])
def test_a_report_that_names_no_decision_kept_leaves_its_decode_out_one_round(named):
    # An overlapping p0 reports while a decode of `seq_id` runs, but names no decision the
    # scheduler keeps (0 after naming one, or one older than the latest three): whether a
    # token is in flight is not known, so the sequence is neither sent nor decoded; the
    # next report names that decision, carries the token, and the SEND books it all.
    sched = fleet(roles=("p0", "d0"))
    register(sched, "d0", role=WorkerRole.DECODE, transfer_bytes_per_second=1e9, max_batch_size=1)
    sched.select_batch(report("d0", kv_free_pages=0))  # no room yet: p0 decodes it
    seq_id = submit(sched, prompt_len=LONG, max_new_tokens=50)
    assert admit(sched, "p0") == (seq_id,)
    first = sched.select_batch(
        _in_turn(report("p0", running=[seq_id]), 1, TokenUpdate(seq_id, (FIRST,), 0))
    )
    decisions = [first]
    for offset in (1, 2, 3):
        decisions.append(
            sched.select_batch(
                _in_turn(
                    report("p0", running=[seq_id]),
                    decisions[-1].iteration,
                    TokenUpdate(seq_id, (offset,), offset),
                )
            )
        )
    assert all(d.decode == (seq_id,) and d.handoffs == () for d in decisions)
    sched.select_batch(report("d0"))  # room now
    stale = 0 if named == "none" else first.iteration
    unknown = sched.select_batch(_in_turn(report("p0", running=[seq_id]), stale))
    assert unknown.decode == () and unknown.handoffs == ()
    # The decode in flight (token 4) ended; p0 applied `unknown` and reports it.
    sent = sched.select_batch(
        _in_turn(report("p0", running=[seq_id]), unknown.iteration, TokenUpdate(seq_id, (4,), 4))
    )
    (send,) = sent.handoffs
    assert (send.num_tokens, send.num_generated) == (LONG + 4, 5)
    (receive,) = sched.select_batch(report("d0")).handoffs
    assert receive.spec.prompt_token_ids[-5:] == (FIRST, 1, 2, 3, 4)


def test_after_a_restart_an_iteration_named_from_before_is_never_trusted():
    # The restarted scheduler numbers p0's decisions from 1 again. p0 (overlapping) named
    # the old scheduler's decision that decodes `seq_id`; its answers lost, it names that
    # number until the new scheduler has given a decision the same number: still not the
    # decision it applied, so the sequence waits a round and the SEND books what p0 holds.
    clock, store = FakeClock(), MemoryStore()
    sched = fleet(store=store, clock=clock, roles=("p0", "d0"))
    sched.select_batch(report("d0", kv_free_pages=0))  # no room: p0 decodes it
    seq_id = submit(sched, prompt_len=LONG, max_new_tokens=50)
    assert admit(sched, "p0") == (seq_id,)
    decoding = sched.select_batch(
        _in_turn(report("p0", running=[seq_id]), 1, TokenUpdate(seq_id, (FIRST,), 0))
    )
    assert decoding.decode == (seq_id,) and decoding.iteration == 3
    restarted = Scheduler(
        make_config(chunk_size=2048, lease_ttl_ms=LEASE_MS),
        clock=clock,
        store=store,
        wall_clock=lambda: 2e9,
    )
    restarted.select_batch(report("d0"))  # room now
    # p0's decode of token 1 runs; the report goes again while answers are lost.
    before = _in_turn(report("p0", running=[seq_id]), decoding.iteration)
    lost = [restarted.select_batch(before) for _ in range(decoding.iteration)]
    assert [d.iteration for d in lost] == [1, 2, 3]
    assert all(d.decode == () and d.handoffs == () for d in lost)
    applied = restarted.select_batch(before)  # this answer arrives
    assert applied.decode == () and applied.handoffs == ()
    sent = restarted.select_batch(
        _in_turn(report("p0", running=[seq_id]), applied.iteration, TokenUpdate(seq_id, (1,), 1))
    )
    (send,) = sent.handoffs
    assert (send.num_tokens, send.num_generated) == (LONG + 1, 2)
    (receive,) = restarted.select_batch(report("d0")).handoffs
    assert receive.spec.prompt_token_ids[-2:] == (FIRST, 1)
