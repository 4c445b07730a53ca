"""A handoff's life and its failure rules (service/core/tables/handoffs.py): nothing
lost, no token twice."""

from __future__ import annotations

import pytest

from service.core import WorkerRole
from service.core.tables.handoffs import HandoffAction, HandoffBook, HandoffState
from service.core.vocabulary import HandoffEnd
from service.state.rows import registration_from_json, registration_json
from tests.unit.factories import admit, make_scheduler, register, registration, report, submit

TIMEOUT = 5.0


def transferring(book: HandoffBook, seq_id: int = 1, now: float = 0.0):
    book.plan(seq_id, "p0", "d0")
    return book.prefilled(seq_id, num_tokens=101, num_generated=1, now=now)


def test_a_handoff_goes_prefilling_transferring_running():
    book = HandoffBook(TIMEOUT)
    assert book.plan(1, "p0", "d0").state is HandoffState.PREFILLING
    handoff = book.prefilled(1, num_tokens=101, num_generated=1, now=10.0)
    assert handoff.state is HandoffState.TRANSFERRING and handoff.deadline == 15.0
    assert book.imported(1, "d0").state is HandoffState.RUNNING
    assert len(book) == 0  # the receiver owns it now, like any sequence


def test_transitions_out_of_order_are_refused():
    book = HandoffBook(TIMEOUT)
    with pytest.raises(ValueError):
        book.imported(1, "d0")  # no handoff
    book.plan(1, "p0", "d0")
    with pytest.raises(ValueError):
        book.imported(1, "d0")  # not transferred yet
    with pytest.raises(ValueError):
        book.plan(1, "p0", "d1")  # twice
    book.prefilled(1, 101, 1, 0.0)
    with pytest.raises(ValueError):
        book.imported(1, "d1")  # not its receiver
    with pytest.raises(ValueError):
        book.plan(2, "p0", "p0")


def test_receiver_tokens_start_where_the_sender_stopped():
    book = HandoffBook(TIMEOUT)
    handoff = transferring(book)
    assert book.receiver_offset_ok(handoff, 1)
    assert not book.receiver_offset_ok(handoff, 0)  # the first token again: twice
    assert not book.receiver_offset_ok(handoff, 2)  # a gap


@pytest.mark.parametrize("state", ["prefilling", "transferring"])
def test_sender_gone_requeues_from_saved_tokens(state):
    book = HandoffBook(TIMEOUT)
    book.plan(1, "p0", "d0")
    if state == "transferring":
        book.prefilled(1, 101, 1, 0.0)
    (outcome,) = book.worker_gone("p0")
    assert outcome.action is HandoffAction.REQUEUE
    assert outcome.failure is HandoffEnd.SENDER_GONE
    assert len(book) == 0


def test_receiver_gone_during_transfer_resumes_on_the_sender():
    book = HandoffBook(TIMEOUT)
    transferring(book)
    (outcome,) = book.worker_gone("d0")
    assert outcome.action is HandoffAction.RESUME_ON_SENDER
    assert outcome.failure is HandoffEnd.RECEIVER_GONE


def test_receiver_gone_after_the_import_is_an_ordinary_requeue():
    book = HandoffBook(TIMEOUT)
    transferring(book)
    book.imported(1, "d0")
    assert book.worker_gone("d0") == []  # the caller requeues d0's sequences as any


def test_timeout_fails_only_late_transfers():
    book = HandoffBook(TIMEOUT)
    transferring(book, 1, now=0.0)
    transferring(book, 2, now=4.0)
    book.plan(3, "p0", "d0")  # still prefilling: no deadline yet
    (outcome,) = book.expire(now=6.0)
    assert outcome.seq_id == 1 and outcome.failure is HandoffEnd.TIMEOUT
    assert outcome.action is HandoffAction.RESUME_ON_SENDER
    assert book.get(2) is not None and book.get(3) is not None


def test_checksum_failure_resumes_on_the_sender_while_it_holds_the_sequence():
    book = HandoffBook(TIMEOUT)
    transferring(book, 1)
    transferring(book, 2)
    held = book.failed(1, HandoffEnd.CHECKSUM, sender_holds=True)
    gone = book.failed(2, HandoffEnd.CHECKSUM, sender_holds=False)
    assert held.action is HandoffAction.RESUME_ON_SENDER
    assert gone.action is HandoffAction.REQUEUE
    assert book.failed(1, HandoffEnd.CHECKSUM, sender_holds=True) is None  # once


def test_a_requeued_handoff_resumes_after_its_saved_first_token():
    """The sender computed the prompt and its first token, then died mid-transfer: the
    sequence resumes on another worker from prompt + that token, generating the second
    (the first is neither lost nor sent twice)."""
    sched = make_scheduler()
    register(sched, "p0", role=WorkerRole.PREFILL, transfer_bytes_per_second=1e9)
    register(sched, "d0", role=WorkerRole.DECODE, transfer_bytes_per_second=1e9)
    seq_id = submit(sched, prompt_len=1024, max_new_tokens=4)  # long: prefilled on p0
    assert admit(sched, "p0") == (seq_id,)
    sched.select_batch(report("p0", running=[seq_id], tokens={seq_id: [42]}))
    book = HandoffBook(TIMEOUT)
    book.plan(seq_id, "p0", "d0")
    book.prefilled(seq_id, num_tokens=1025, num_generated=1, now=0.0)
    assert sched.deregister_worker("p0") == 1  # the mechanism requeues its sequences
    (outcome,) = book.worker_gone("p0")
    assert outcome.action is HandoffAction.REQUEUE
    decision = sched.select_batch(report("d0"))
    (chunk,) = decision.prefill
    assert tuple(chunk.spec.prompt_token_ids) == (*range(1, 1025), 42)
    assert chunk.spec.max_new_tokens == 3
    assert tuple(sched.read_output(seq_id, 0).token_ids) == (42,)


def test_a_worker_role_survives_the_store():
    saved = registration("p0", role=WorkerRole.PREFILL, transfer_bytes_per_second=2.5e9)
    assert registration_from_json(registration_json(saved)) == saved
    old = '{"worker_id": "w", "total_kv_pages": 1, "page_size": 1, "total_gdn_slots": 1, '
    old += '"max_batch_size": 0, "adapters": []}'
    assert registration_from_json(old).role is WorkerRole.BOTH


def test_every_field_of_a_registration_survives_the_store():
    # A recovered worker keeps its cache's block size and snapshot slots: without them it
    # would be sent chunks that a vLLM worker in align mode refuses, again and again.
    saved = registration(
        "w", cache_block_tokens=256, total_snapshot_slots=12, handoff_address="10.0.0.2:7000"
    )
    assert registration_from_json(registration_json(saved)) == saved
