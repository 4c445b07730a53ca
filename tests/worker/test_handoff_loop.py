"""Two worker loops, a sender and a receiver, driven by a fake scheduler's decisions
(tests/worker/test_handoff_channel.py covers the channel itself): the sequence moves over
the real handoff channel, decodes on the receiver to the tokens it gives where it was
prefilled, is reported DONE once, then running, with its first token at the offset the
handoff named; a failed handoff leaves the receiver holding nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.waiting import wait_until
from lattice.scheduler.v1 import scheduler_pb2 as pb
from worker_client import convert
from worker_client.engine.api import SequenceSpec
from worker_client.engine.engine import ModelEngine
from worker_client.engine.loading import load_model
from worker_client.handoff_channel import (
    FetchFailed,
    FetchProblem,
    HandoffServer,
    OfferBook,
    fetch_sequence,
)
from worker_client.handoffs import HandoffAgent
from worker_client.loop import WorkerLoop
from worker_client.resources import WorkerResources, WorkerRole

PROMPT = tuple(range(5, 41))
NUM_NEW = 8


class FakeScheduler:
    """A client whose every answer is the next decision the test queued (empty when none)."""

    def __init__(self) -> None:
        self.decisions: list[pb.SchedulerDecision] = []
        self.requests: list[pb.SelectBatchRequest] = []
        self.registrations: list[pb.RegisterWorkerRequest] = []

    def register(self, resources: WorkerResources) -> pb.RegisterWorkerResponse:
        self.registrations.append(convert.register_request(resources))
        return pb.RegisterWorkerResponse(chunk_size=512, max_batch_size=8, lease_ttl_ms=10_000)

    def select(self, request: pb.SelectBatchRequest) -> pb.SchedulerDecision:
        self.requests.append(request)
        return self.decisions.pop(0) if self.decisions else pb.SchedulerDecision()

    def deregister(self, worker_id: str) -> int:
        return 0


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", device="cpu", dtype=torch.float32, seed=0)


def _engine(model) -> ModelEngine:
    return ModelEngine(model, total_kv_pages=64, page_size=4, total_gdn_slots=4, device="cpu")


class Worker:
    """A worker loop on its own engine, fake scheduler and (for a sender) handoff server."""

    def __init__(self, model, worker_id: str, role: WorkerRole, *, serve: bool, fetcher=None):
        self.engine = _engine(model)
        self.scheduler = FakeScheduler()
        self.offers = OfferBook() if serve else None
        self.server = None
        address = ""
        if serve:
            self.server = HandoffServer(self.offers, host="127.0.0.1")
            self.server.start()
            address = f"127.0.0.1:{self.server.port}"
        self.agent = HandoffAgent(self.engine, self.offers, fetcher or _fetch)
        resources = dataclasses.replace(
            WorkerResources.of(worker_id, self.engine),
            role=role,
            transfer_bytes_per_second=1e9,
            handoff_address=address,
        )
        self.loop = WorkerLoop(
            self.engine, self.scheduler, resources, overlap=False, handoffs=self.agent
        )
        self.loop.register()

    def step(self, decision: pb.SchedulerDecision) -> pb.SelectBatchRequest:
        """Report, get `decision`, run it; the report sent."""
        self.scheduler.decisions.append(decision)
        self.loop.iterate()
        return self.scheduler.requests[-1]

    def close(self) -> None:
        self.agent.close()
        if self.server is not None:
            self.server.stop(0)


def _fetch(order, timeout_seconds):
    return fetch_sequence(
        order.peer_address,
        order.transfer_id,
        order.seq_id,
        order.cached_tokens,
        timeout_seconds=timeout_seconds,
    )


def _wire_spec(prompt, max_new_tokens) -> pb.SequenceSpec:
    return pb.SequenceSpec(
        prompt_token_ids=prompt,
        max_new_tokens=max_new_tokens,
        sampling=pb.SamplingParams(ignore_eos=True),
    )


def _tokens(request: pb.SelectBatchRequest, seq_id: int) -> list[tuple[int, list[int]]]:
    return [(u.offset, list(u.token_ids)) for u in request.tokens if u.seq_id == seq_id]


def _alone(model) -> list[int]:
    engine = _engine(model)
    spec = SequenceSpec(PROMPT, NUM_NEW, ignore_eos=True)
    from worker_client.engine.api import ChunkWork

    out = [
        t for _, ids in engine.step([ChunkWork(1, 0, len(PROMPT), spec)], []).tokens for t in ids
    ]
    while engine.running_ids():
        out += [t for _, ids in engine.step([], [1]).tokens for t in ids]
    return out


@pytest.fixture
def workers(model):
    made = []

    def make(*args, **kwargs) -> Worker:
        made.append(Worker(model, *args, **kwargs))
        return made[-1]

    yield make
    for worker in made:
        worker.close()


def test_a_sequence_handed_off_decodes_on_the_receiver_as_it_would_have_on_the_sender(
    model, workers
):
    sender = workers("prefill-0", WorkerRole.PREFILL, serve=True)
    receiver = workers("decode-0", WorkerRole.DECODE, serve=False)
    assert sender.scheduler.registrations[0].role == pb.WORKER_ROLE_PREFILL
    assert sender.scheduler.registrations[0].handoff_address.startswith("127.0.0.1:")
    assert receiver.scheduler.registrations[0].transfer_bytes_per_second == 1e9

    prefill = pb.PrefillChunk(seq_id=1, chunk_start=0, chunk_len=len(PROMPT))
    prefill.spec.CopyFrom(_wire_spec(PROMPT, NUM_NEW))
    sender.step(pb.SchedulerDecision(prefill=[prefill]))
    send = pb.Handoff(
        seq_id=1,
        direction=pb.HANDOFF_DIRECTION_SEND,
        transfer_id=77,
        peer_worker_id="decode-0",
        num_tokens=len(PROMPT),
        num_generated=1,
    )
    # The first token goes with the report that gets the SEND; decode_all_running would
    # decode the sequence, but a sequence held for a peer is not decoded.
    report = sender.step(pb.SchedulerDecision(handoffs=[send], decode_all_running=True))
    [(offset, [first])] = _tokens(report, 1)
    assert offset == 0
    report = sender.step(pb.SchedulerDecision())
    assert list(report.running) == [1] and not report.tokens  # held, not decoded

    receive = pb.Handoff(
        seq_id=1,
        direction=pb.HANDOFF_DIRECTION_RECEIVE,
        transfer_id=77,
        peer_worker_id="prefill-0",
        peer_address=sender.scheduler.registrations[0].handoff_address,
        num_tokens=len(PROMPT),
        num_generated=1,
        spec=_wire_spec((*PROMPT, first), NUM_NEW - 1),
        deadline_ms=30_000,
    )
    receiver.step(pb.SchedulerDecision(handoffs=[receive]))
    wait_until(lambda: receiver.agent.num_fetching() == 0, "the fetch to end", 30)
    report = receiver.step(pb.SchedulerDecision(decode=[1]))
    [result] = report.handoffs
    assert (result.seq_id, result.transfer_id, result.status) == (1, 77, pb.HANDOFF_STATUS_DONE)
    assert result.num_bytes > 0 and not result.error_message
    assert list(report.running) == [1]

    generated = [first]
    offsets = []
    while True:
        report = receiver.step(pb.SchedulerDecision(decode=[1]))
        assert not report.handoffs  # DONE is reported once
        for offset, ids in _tokens(report, 1):
            offsets.append(offset)
            generated += ids
        if report.finished:
            break
    assert offsets[0] == 1  # num_generated: the sender's first token is not counted twice
    assert generated == _alone(model)

    # DONE reached the scheduler, which evicts the sender's copy: no longer served.
    sender.step(pb.SchedulerDecision(evict=[1]))
    assert len(sender.offers) == 0 and sender.engine.running_ids() == []


def test_a_handoff_from_a_sender_without_the_transfer_is_reported_once_and_holds_nothing(
    model, workers
):
    sender = workers("prefill-0", WorkerRole.PREFILL, serve=True)
    receiver = workers("decode-0", WorkerRole.DECODE, serve=False)
    receive = pb.Handoff(
        seq_id=4,
        direction=pb.HANDOFF_DIRECTION_RECEIVE,
        transfer_id=9,
        peer_address=sender.scheduler.registrations[0].handoff_address,
        num_tokens=len(PROMPT),
        num_generated=1,
        spec=_wire_spec((*PROMPT, 3), 4),
    )
    receiver.step(pb.SchedulerDecision(handoffs=[receive]))
    wait_until(lambda: receiver.agent.num_fetching() == 0, "the fetch to end", 30)
    report = receiver.step(pb.SchedulerDecision())
    [result] = report.handoffs
    assert result.status == pb.HANDOFF_STATUS_UNKNOWN_SEQUENCE and result.error_message
    assert list(report.running) == [] and receiver.engine.gdn_free_slots() == 4
    assert not receiver.step(pb.SchedulerDecision()).handoffs


def test_a_transfer_failing_its_checksum_is_reported_and_never_run(model, workers):
    def corrupted(order, timeout_seconds):
        raise FetchFailed(FetchProblem.CHECKSUM_MISMATCH, "chunk 3 fails its CRC32C check")

    receiver = workers("decode-0", WorkerRole.DECODE, serve=False, fetcher=corrupted)
    receive = pb.Handoff(
        seq_id=4,
        direction=pb.HANDOFF_DIRECTION_RECEIVE,
        transfer_id=9,
        peer_address="127.0.0.1:1",
        num_tokens=len(PROMPT),
        num_generated=1,
        spec=_wire_spec((*PROMPT, 3), 4),
    )
    receiver.step(pb.SchedulerDecision(handoffs=[receive]))
    wait_until(lambda: receiver.agent.num_fetching() == 0, "the fetch to end", 30)
    report = receiver.step(pb.SchedulerDecision(decode=[4]))
    [result] = report.handoffs
    assert result.status == pb.HANDOFF_STATUS_CHECKSUM_MISMATCH
    assert "CRC32C" in result.error_message
    assert list(report.running) == [] and receiver.engine.running_ids() == []


def test_a_worker_of_role_both_registers_as_before_roles():
    resources = WorkerResources("w", total_kv_pages=8, page_size=4, total_gdn_slots=2)
    request = convert.register_request(resources)
    assert request == pb.RegisterWorkerRequest(
        worker_id="w", total_kv_pages=8, page_size=4, total_gdn_slots=2
    )


def test_a_prefill_worker_registers_its_handoff_sizes():
    resources = WorkerResources(
        "w",
        total_kv_pages=8,
        page_size=4,
        total_gdn_slots=2,
        role=WorkerRole.PREFILL,
        handoff_bytes_per_token=512.0,
        handoff_fixed_bytes=16384.0,
    )
    request = convert.register_request(resources)
    assert (request.handoff_bytes_per_token, request.handoff_fixed_bytes) == (512.0, 16384.0)


def _prefilled_sender(workers, num_tokens: int) -> Worker:
    """A prefill worker that prefilled PROMPT as sequence 1 and was told to SEND it."""
    sender = workers("prefill-0", WorkerRole.PREFILL, serve=True)
    prefill = pb.PrefillChunk(seq_id=1, chunk_start=0, chunk_len=len(PROMPT))
    prefill.spec.CopyFrom(_wire_spec(PROMPT, NUM_NEW))
    sender.step(pb.SchedulerDecision(prefill=[prefill]))
    send = pb.Handoff(
        seq_id=1,
        direction=pb.HANDOFF_DIRECTION_SEND,
        transfer_id=77,
        num_tokens=num_tokens,
        num_generated=1,
    )
    sender.step(pb.SchedulerDecision(handoffs=[send]))
    return sender


def test_a_sequence_held_for_a_send_and_named_in_decode_is_the_senders_again(workers):
    sender = _prefilled_sender(workers, len(PROMPT))
    assert len(sender.offers) == 1
    sender.step(pb.SchedulerDecision(decode=[1]))  # the handoff failed: decode it here
    assert len(sender.offers) == 0
    report = sender.step(pb.SchedulerDecision(decode=[1]))
    assert [offset for offset, _ in _tokens(report, 1)] == [1]


def test_a_sender_past_the_sends_tokens_serves_nothing(workers):
    # It decoded once more than the scheduler knew when it sent the SEND.
    sender = _prefilled_sender(workers, len(PROMPT) - 1)
    assert len(sender.offers) == 0 and sender.engine.running_ids() == [1]
