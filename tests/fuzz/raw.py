"""Bytes on the wire: raw (serializer-less) calls, byte mutations, and plain sockets."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

import grpc
from hypothesis import strategies as st

from tests.fuzz.target import STREAMED, waiting
from tests.server.wire import RPC_TIMEOUT_SECONDS

# How grpc itself answers a request whose bytes do not parse (service/server/interceptors/decode_errors.py
# answers those first, with INVALID_ARGUMENT): this answer should never be seen.
GRPC_DECODE_FAILURE = "Exception deserializing request!"
# In the details of service/server/interceptors/decode_errors.py's answer.
DOES_NOT_PARSE = "does not parse"
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


@dataclass(frozen=True)
class RawOutcome:
    code: grpc.StatusCode
    details: str
    response: bytes | None = None


def raw_call(channel: grpc.Channel, path: str, payload: bytes, streaming: str = "") -> RawOutcome:
    """Send `payload` as the request bytes of the method at `path` ("/service/Method").

    `streaming` is "" for a unary call, "response" for a response stream (read up to its
    first message, then cancelled), "both" for a stream each way (one request sent).
    Scheduler/Generate and Scheduler/FollowSequence are always read as response streams
    (target.STREAMED: a follow still open at its deadline is waiting for tokens: OK).
    """
    method = path.rsplit("/", 1)[-1]
    timeout = STREAMED.get(method, RPC_TIMEOUT_SECONDS)
    if method in STREAMED:
        streaming = "response"
    try:
        if not streaming:
            response = channel.unary_unary(path)(payload, timeout=timeout)
            return RawOutcome(grpc.StatusCode.OK, "", response)
        stream = (
            channel.unary_stream(path)(payload, timeout=timeout)
            if streaming == "response"
            else channel.stream_stream(path)(iter([payload]), timeout=timeout)
        )
        try:
            return RawOutcome(grpc.StatusCode.OK, "", next(stream))
        finally:
            stream.cancel()
    except grpc.RpcError as err:
        if waiting(method, err.code()):
            return RawOutcome(grpc.StatusCode.OK, "")
        return RawOutcome(err.code(), err.details() or "")


# ------------------------------------------------------------------ mutations


def mutations() -> st.SearchStrategy[list[tuple]]:
    """One to four edits; positions are taken modulo the length of what they edit."""
    position = st.integers(0, 2**16)
    edit = st.one_of(
        st.tuples(st.just("flip"), position, st.integers(0, 7)),
        st.tuples(st.just("set"), position, st.sampled_from((0x00, 0x7F, 0x80, 0xFF))),
        st.tuples(st.just("insert"), position, st.binary(min_size=1, max_size=16)),
        st.tuples(st.just("delete"), position, st.integers(1, 8)),
        st.tuples(st.just("truncate"), position),
        st.tuples(st.just("repeat"), position, st.integers(1, 64)),
    )
    return st.lists(edit, min_size=1, max_size=4)


def mutate(data: bytes, edits: list[tuple]) -> bytes:
    buf = bytearray(data)
    for kind, pos, *arg in edits:
        at = pos % (len(buf) + 1)
        if kind == "flip" and buf:
            buf[at % len(buf)] ^= 1 << arg[0]
        elif kind == "set" and buf:
            buf[at % len(buf)] = arg[0]
        elif kind == "insert":
            buf[at:at] = arg[0]
        elif kind == "delete":
            del buf[at : at + arg[0]]
        elif kind == "truncate":
            del buf[at:]
        elif kind == "repeat":
            buf[at:at] = buf[at : at + arg[0]]
    return bytes(buf)


# ------------------------------------------------------------------ sockets


def send_raw(port: int, payload: bytes, wait_seconds: float = 2.0) -> tuple[bytes, bool]:
    """Connect to 127.0.0.1:port, send `payload`, read until the server closes or
    `wait_seconds` pass; returns (bytes received, whether the server closed)."""
    received = bytearray()
    deadline = time.monotonic() + wait_seconds
    with socket.create_connection(("127.0.0.1", port), timeout=wait_seconds) as sock:
        try:
            sock.sendall(payload)
        except OSError:
            return bytes(received), True  # closed (reset) while we were still sending
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            except OSError:
                return bytes(received), True
            if not chunk:
                return bytes(received), True
            received += chunk
    return bytes(received), False
