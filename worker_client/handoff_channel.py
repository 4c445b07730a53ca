"""The handoff channel between workers (lattice.handoff.v1): a sender serves the state of
the sequences it was told to SEND, a receiver fetches one and checks it.

Every chunk carries the CRC32C of its bytes and the stream ends with the totals; the
receiver checks both and keeps nothing of a transfer that fails them (contract failure
rule 4). Calls carry `authorization: Bearer <token>` and the server refuses any other
token (UNAUTHENTICATED); TLS as on the scheduler's channel.

Failures come back as `FetchFailed` with the contract's status:
- the sender unreachable, refusing the token, or closing the stream early:
  SENDER_UNREACHABLE;
- a chunk whose checksum does not match, or totals that do not: CHECKSUM_MISMATCH;
- the deadline passed: TIMED_OUT;
- the sender holds no such transfer: UNKNOWN_SEQUENCE.
"""

from __future__ import annotations

import enum
import hmac
import logging
import threading
from concurrent import futures
from dataclasses import dataclass

import google_crc32c
import grpc

from common.credentials import token_metadata
from lattice.handoff.v1 import handoff_pb2 as hpb
from lattice.handoff.v1 import handoff_pb2_grpc as hpb_grpc
from worker_client.engine.api import StateChunk, StateKind

log = logging.getLogger(__name__)

_KIND_TO_WIRE = {
    StateKind.ATTENTION_KV: hpb.STATE_KIND_ATTENTION_KV,
    StateKind.GDN_RECURRENT: hpb.STATE_KIND_GDN_RECURRENT,
    StateKind.GDN_CONV: hpb.STATE_KIND_GDN_CONV,
}
_KIND_FROM_WIRE = {wire: kind for kind, wire in _KIND_TO_WIRE.items()}
# A chunk is at most handoff.MAX_CHUNK_BYTES (1 MiB) of data: room to spare at 8 MiB.
_MAX_MESSAGE_BYTES = 8 << 20
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
]


class FetchProblem(enum.Enum):
    """Why a fetch failed, in the contract's HandoffStatus terms."""

    SENDER_UNREACHABLE = "sender_unreachable"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    TIMED_OUT = "timed_out"
    UNKNOWN_SEQUENCE = "unknown_sequence"


class FetchFailed(Exception):
    """A fetch that brought nothing usable; `problem` says why."""

    def __init__(self, problem: FetchProblem, message: str) -> None:
        super().__init__(message)
        self.problem = problem


@dataclass(frozen=True)
class Fetched:
    """A checked transfer: the chunks, and the bytes of their data."""

    chunks: tuple[StateChunk, ...]
    num_bytes: int


def crc32c(data: bytes) -> int:
    return google_crc32c.value(data)


# ---------------------------------------------------------------------------- sender


@dataclass(frozen=True)
class _Offer:
    seq_id: int
    chunks: tuple[StateChunk, ...]


# How long a fetch waits for its transfer to be offered: an overlapping sender applies a
# SEND only once the step it runs ends, and its receiver may ask before that.
OFFER_WAIT_SECONDS = 5.0


class OfferBook:
    """The transfers a sender serves: transfer_id -> the sequence's exported chunks
    (thread-safe: the loop offers and withdraws, the server's threads read)."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._offers: dict[int, _Offer] = {}

    def offer(self, transfer_id: int, seq_id: int, chunks: tuple[StateChunk, ...]) -> None:
        with self._lock:
            self._offers[transfer_id] = _Offer(seq_id, chunks)
            self._lock.notify_all()

    def withdraw(self, seq_ids) -> None:
        """Stop serving every transfer of these sequences."""
        gone = set(seq_ids)
        with self._lock:
            for transfer_id in [t for t, o in self._offers.items() if o.seq_id in gone]:
                del self._offers[transfer_id]

    def offers(self, transfer_id: int) -> bool:
        """Whether `transfer_id` is served."""
        with self._lock:
            return transfer_id in self._offers

    def get(
        self, transfer_id: int, seq_id: int, wait_seconds: float = 0.0
    ) -> tuple[StateChunk, ...] | None:
        """The transfer's chunks; None if it is not offered within `wait_seconds` (a
        receiver may ask while its sender still runs the step before its SEND)."""
        with self._lock:
            self._lock.wait_for(lambda: transfer_id in self._offers, max(0.0, wait_seconds))
            offer = self._offers.get(transfer_id)
        return None if offer is None or offer.seq_id != seq_id else offer.chunks

    def __len__(self) -> int:
        with self._lock:
            return len(self._offers)


class _Servicer(hpb_grpc.HandoffChannelServicer):
    def __init__(self, offers: OfferBook, token: str | None, offer_wait_seconds: float) -> None:
        self._offers = offers
        self._token = token
        self._offer_wait_seconds = offer_wait_seconds

    def FetchSequence(self, request, context):
        if self._token is not None and not _has_token(context, self._token):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "handoff channel: wrong or no token")
        remaining = context.time_remaining()
        wait = self._offer_wait_seconds
        if remaining is not None:
            wait = min(wait, remaining)
        chunks = self._offers.get(request.transfer_id, request.seq_id, wait)
        if chunks is None:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no transfer {request.transfer_id:#x} of sequence {request.seq_id} here",
            )
        num_chunks = num_bytes = 0
        for chunk in chunks:
            chunk = trim(chunk, request.first_token)
            if chunk is None:
                continue
            num_chunks += 1
            num_bytes += len(chunk.data)
            yield hpb.FetchSequenceResponse(chunk=to_wire(chunk))
        yield hpb.FetchSequenceResponse(
            totals=hpb.TransferTotals(num_chunks=num_chunks, num_bytes=num_bytes)
        )


class HandoffServer:
    """The sender's end: a gRPC server on `port` ("0": any free one) serving `offers`."""

    def __init__(
        self,
        offers: OfferBook,
        *,
        host: str = "[::]",
        port: int = 0,
        credentials: grpc.ServerCredentials | None = None,
        token: str | None = None,
        max_workers: int = 4,
        offer_wait_seconds: float = OFFER_WAIT_SECONDS,
    ) -> None:
        """`offer_wait_seconds`: how long a fetch waits for its transfer to be offered
        before it is answered NOT_FOUND (UNKNOWN_SEQUENCE)."""
        self.offers = offers
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers, thread_name_prefix="handoff"),
            options=_CHANNEL_OPTIONS,
        )
        hpb_grpc.add_HandoffChannelServicer_to_server(
            _Servicer(offers, token, offer_wait_seconds), self._server
        )
        address = f"{host}:{port}"
        if credentials is None:
            self.port = self._server.add_insecure_port(address)
        else:
            self.port = self._server.add_secure_port(address, credentials)

    def start(self) -> None:
        self._server.start()

    def stop(self, grace_seconds: float = 1.0) -> None:
        self._server.stop(grace_seconds).wait()


# ---------------------------------------------------------------------------- receiver


def fetch_sequence(
    address: str,
    transfer_id: int,
    seq_id: int,
    first_token: int,
    *,
    timeout_seconds: float,
    credentials: grpc.ChannelCredentials | None = None,
    token: str | None = None,
    max_bytes: int | None = None,
) -> Fetched:
    """Fetch and check one transfer from the sender at `address` (HOST:PORT); raises
    FetchFailed, having kept nothing, when it cannot. `max_bytes`: the most chunk data the
    receiver expects (None: no bound); a stream past it is cut there and fails its check,
    so a wrong or hostile sender cannot fill the receiver's memory."""
    if credentials is None:
        channel = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
    else:
        channel = grpc.secure_channel(address, credentials, options=_CHANNEL_OPTIONS)
    request = hpb.FetchSequenceRequest(
        transfer_id=transfer_id, seq_id=seq_id, first_token=first_token
    )
    with channel:
        stub = hpb_grpc.HandoffChannelStub(channel)
        try:
            responses = stub.FetchSequence(
                request, timeout=timeout_seconds, metadata=token_metadata(token)
            )
            return _receive(responses, address, max_bytes)
        except grpc.RpcError as err:
            raise _failure(err, address) from None


def _receive(responses, address: str, max_bytes: int | None = None) -> Fetched:
    chunks: list[StateChunk] = []
    num_bytes = 0
    for response in responses:
        if response.HasField("totals"):
            totals = response.totals
            if (totals.num_chunks, totals.num_bytes) != (len(chunks), num_bytes):
                raise FetchFailed(
                    FetchProblem.CHECKSUM_MISMATCH,
                    f"{address} sent {len(chunks)} chunks of {num_bytes} bytes, its totals say "
                    f"{totals.num_chunks} of {totals.num_bytes}",
                )
            return Fetched(tuple(chunks), num_bytes)
        wire = response.chunk
        if max_bytes is not None and num_bytes + len(wire.data) > max_bytes:
            raise FetchFailed(
                FetchProblem.CHECKSUM_MISMATCH,
                f"{address} sent more than the {max_bytes} bytes this transfer takes",
            )
        if crc32c(wire.data) != wire.crc32c:
            raise FetchFailed(
                FetchProblem.CHECKSUM_MISMATCH,
                f"chunk {len(chunks)} from {address} fails its CRC32C check",
            )
        chunks.append(from_wire(wire))
        num_bytes += len(wire.data)
    raise FetchFailed(
        FetchProblem.SENDER_UNREACHABLE, f"{address} closed the transfer before its totals"
    )


def _failure(err: grpc.RpcError, address: str) -> FetchFailed:
    code = err.code()
    details = f"{address}: {code.name}: {err.details()}"
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return FetchFailed(
            FetchProblem.TIMED_OUT, f"the transfer ran past its deadline ({details})"
        )
    if code is grpc.StatusCode.NOT_FOUND:
        return FetchFailed(FetchProblem.UNKNOWN_SEQUENCE, details)
    return FetchFailed(FetchProblem.SENDER_UNREACHABLE, details)


# ---------------------------------------------------------------------------- conversion


def to_wire(chunk: StateChunk) -> hpb.StateChunk:
    return hpb.StateChunk(
        kind=_KIND_TO_WIRE[chunk.kind],
        layer=chunk.layer,
        first_token=chunk.first_token,
        num_tokens=chunk.num_tokens,
        data=chunk.data,
        crc32c=crc32c(chunk.data),
    )


def from_wire(wire: hpb.StateChunk) -> StateChunk:
    kind = _KIND_FROM_WIRE.get(wire.kind)
    if kind is None:
        raise FetchFailed(FetchProblem.CHECKSUM_MISMATCH, f"a chunk of unknown kind {wire.kind}")
    return StateChunk(kind, wire.layer, wire.data, wire.first_token, wire.num_tokens)


def trim(chunk: StateChunk, first_token: int) -> StateChunk | None:
    """`chunk` without its KV positions before `first_token` (None if nothing is left);
    GDN states whole."""
    if chunk.kind is not StateKind.ATTENTION_KV or chunk.first_token >= first_token:
        return chunk
    end = chunk.first_token + chunk.num_tokens
    if end <= first_token:
        return None
    num_kept = end - first_token
    half = len(chunk.data) // 2
    per_token = half // chunk.num_tokens
    skip = (first_token - chunk.first_token) * per_token
    data = chunk.data[skip:half] + chunk.data[half + skip :]
    return StateChunk(chunk.kind, chunk.layer, data, first_token, num_kept)


def _has_token(context: grpc.ServicerContext, token: str) -> bool:
    expected = f"Bearer {token}"
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and hmac.compare_digest(str(value), expected):
            return True
    return False
