"""The handoff channel between workers: a checked transfer arrives whole; a corrupted,
cut, late, unknown or unauthenticated one fails with the contract's status and hands the
receiver nothing."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest

from lattice.handoff.v1 import handoff_pb2 as hpb
from lattice.handoff.v1 import handoff_pb2_grpc as hpb_grpc
from worker_client.engine.api import StateChunk, StateKind
from worker_client.handoff_channel import (
    FetchFailed,
    FetchProblem,
    HandoffServer,
    OfferBook,
    fetch_sequence,
    to_wire,
    trim,
)

TOKEN = "handoff-secret"
# How long the sender waits for a transfer to be offered before NOT_FOUND.
WAIT = 1.0


def _chunks() -> tuple[StateChunk, ...]:
    # Two layers of 6 positions, 2 bytes a position for keys and 2 for values; one GDN layer.
    kv = [
        StateChunk(
            StateKind.ATTENTION_KV,
            layer,
            bytes(range(layer * 50, layer * 50 + 12)) + bytes(range(100, 112)),
            0,
            6,
        )
        for layer in range(2)
    ]
    gdn = [
        StateChunk(StateKind.GDN_RECURRENT, 0, b"recurrent" * 3),
        StateChunk(StateKind.GDN_CONV, 0, b"conv"),
    ]
    return (*kv, *gdn)


@pytest.fixture
def sender():
    offers = OfferBook()
    server = HandoffServer(offers, host="127.0.0.1", token=TOKEN, offer_wait_seconds=WAIT)
    server.start()
    yield offers, f"127.0.0.1:{server.port}"
    server.stop(0)


def _fetch(address, transfer_id=7, seq_id=3, first_token=0, timeout=10.0, token=TOKEN):
    return fetch_sequence(
        address, transfer_id, seq_id, first_token, timeout_seconds=timeout, token=token
    )


def test_a_fetched_transfer_is_the_offered_chunks_with_their_byte_count(sender):
    offers, address = sender
    offers.offer(7, 3, _chunks())
    fetched = _fetch(address)
    assert fetched.chunks == _chunks()
    assert fetched.num_bytes == sum(len(c.data) for c in _chunks())


def test_a_fetch_past_cached_tokens_gets_only_the_later_positions(sender):
    offers, address = sender
    offers.offer(7, 3, _chunks())
    fetched = _fetch(address, first_token=4)
    kv = [c for c in fetched.chunks if c.kind is StateKind.ATTENTION_KV]
    assert [(c.first_token, c.num_tokens) for c in kv] == [(4, 2), (4, 2)]
    # Keys of positions 4 and 5, then their values.
    assert kv[0].data == bytes(range(8, 12)) + bytes(range(108, 112))
    assert len(fetched.chunks) == 4  # the GDN states whole


def test_a_stream_past_the_bytes_the_receiver_expects_is_cut_and_fails_its_check(sender):
    offers, address = sender
    offers.offer(7, 3, _chunks())
    total = sum(len(c.data) for c in _chunks())
    fetched = fetch_sequence(address, 7, 3, 0, timeout_seconds=10.0, token=TOKEN, max_bytes=total)
    assert fetched.num_bytes == total
    with pytest.raises(FetchFailed) as failed:
        fetch_sequence(address, 7, 3, 0, timeout_seconds=10.0, token=TOKEN, max_bytes=total - 1)
    assert failed.value.problem is FetchProblem.CHECKSUM_MISMATCH


def test_trim_drops_chunks_wholly_before_the_first_token():
    chunk = StateChunk(StateKind.ATTENTION_KV, 0, b"abcdWXYZ", 2, 2)
    assert trim(chunk, 4) is None
    assert trim(chunk, 2) is chunk
    assert trim(chunk, 3) == StateChunk(StateKind.ATTENTION_KV, 0, b"cdYZ", 3, 1)


def test_a_fetch_that_comes_before_its_offer_gets_it_once_offered(sender):
    # An overlapping sender applies its SEND when its step ends; the receiver may ask first.
    offers, address = sender
    threading.Timer(WAIT / 4, offers.offer, (7, 3, _chunks())).start()
    assert _fetch(address).chunks == _chunks()


def test_an_unknown_or_withdrawn_transfer_is_unknown_sequence(sender):
    offers, address = sender
    with pytest.raises(FetchFailed) as failed:
        _fetch(address)
    assert failed.value.problem is FetchProblem.UNKNOWN_SEQUENCE
    offers.offer(7, 3, _chunks())
    with pytest.raises(FetchFailed) as failed:
        _fetch(address, seq_id=4)  # the transfer is another sequence's
    assert failed.value.problem is FetchProblem.UNKNOWN_SEQUENCE
    offers.withdraw([3])
    with pytest.raises(FetchFailed) as failed:
        _fetch(address)
    assert failed.value.problem is FetchProblem.UNKNOWN_SEQUENCE


def test_a_wrong_token_is_refused(sender):
    offers, address = sender
    offers.offer(7, 3, _chunks())
    with pytest.raises(FetchFailed) as failed:
        _fetch(address, token="not-it")
    assert failed.value.problem is FetchProblem.SENDER_UNREACHABLE
    assert "UNAUTHENTICATED" in str(failed.value)


def test_a_sender_that_is_gone_is_sender_unreachable():
    server = HandoffServer(OfferBook(), host="127.0.0.1")
    server.start()
    port = server.port
    server.stop(0)
    with pytest.raises(FetchFailed) as failed:
        _fetch(f"127.0.0.1:{port}", timeout=5.0)
    assert failed.value.problem is FetchProblem.SENDER_UNREACHABLE


class _Faulty(hpb_grpc.HandoffChannelServicer):
    """A sender that misbehaves in one way: `fault` names it."""

    def __init__(self, fault: str) -> None:
        self.fault = fault
        self.release = threading.Event()

    def FetchSequence(self, request, context):
        chunks = [to_wire(c) for c in _chunks()]
        if self.fault == "flipped_byte":
            chunks[1].data = bytes([chunks[1].data[0] ^ 1]) + chunks[1].data[1:]
        yield hpb.FetchSequenceResponse(chunk=chunks[0])
        if self.fault == "cut":
            context.abort(grpc.StatusCode.UNAVAILABLE, "sender going away")
        if self.fault == "stall":
            self.release.wait(30)
        for chunk in chunks[1:]:
            yield hpb.FetchSequenceResponse(chunk=chunk)
        num_chunks = len(chunks) - (1 if self.fault == "short_totals" else 0)
        num_bytes = sum(len(c.data) for c in chunks)
        yield hpb.FetchSequenceResponse(
            totals=hpb.TransferTotals(num_chunks=num_chunks, num_bytes=num_bytes)
        )


@pytest.fixture
def faulty_sender():
    servers = []

    def start(fault: str) -> tuple[_Faulty, str]:
        servicer = _Faulty(fault)
        server = grpc.server(futures.ThreadPoolExecutor(2))
        hpb_grpc.add_HandoffChannelServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append((server, servicer))
        return servicer, f"127.0.0.1:{port}"

    yield start
    for server, servicer in servers:
        servicer.release.set()
        server.stop(0)


@pytest.mark.parametrize(
    "fault, problem",
    [
        ("flipped_byte", FetchProblem.CHECKSUM_MISMATCH),
        ("short_totals", FetchProblem.CHECKSUM_MISMATCH),
        ("cut", FetchProblem.SENDER_UNREACHABLE),
        ("stall", FetchProblem.TIMED_OUT),
    ],
)
def test_a_faulty_transfer_fails_with_its_status(faulty_sender, fault, problem):
    _, address = faulty_sender(fault)
    with pytest.raises(FetchFailed) as failed:
        _fetch(address, timeout=0.5 if fault == "stall" else 10.0, token=None)
    assert failed.value.problem is problem


def test_the_same_sender_passes_unfaulted(faulty_sender):
    # The faulty sender's honest path: the faults above are what failed, not the harness.
    _, address = faulty_sender("none")
    assert _fetch(address, token=None).chunks == _chunks()
