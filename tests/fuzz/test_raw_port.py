"""Garbage straight to the gRPC port: not HTTP/2, half an HTTP/2 preface, floods of
connections. grpc's transport rejects it; the scheduler keeps answering valid calls."""

from __future__ import annotations

import random
import socket
import time

import pytest

from .raw import HTTP2_PREFACE, send_raw

# The first frame a grpc server sends on any connection: its SETTINGS (type 0x4).
_SETTINGS_FRAME_TYPE = 0x04
# A connection the transport rejects is closed well within this.
_CLOSE_SECONDS = 2.0


def _garbage(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


@pytest.mark.parametrize(
    "payload",
    [
        _garbage(1, 1),
        _garbage(2, 24),
        _garbage(3, 4096),
        _garbage(4, 256 * 1024),
        b"\x00" * 1024,
        b"\xff" * 1024,
        b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        b"POST /lattice.scheduler.v1.Scheduler/Submit HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/grpc\r\nContent-Length: 5\r\n\r\n\x00\x00\x00\x00\x00",
        b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + bytes(32),  # a TLS ClientHello's start
        HTTP2_PREFACE + _garbage(5, 512),  # preface, then no frame
        HTTP2_PREFACE + b"\x00\xff\xff\xff\x01\x00\x00\x00\x01",  # a frame far too large
    ],
    ids=[
        "1-byte",
        "24-bytes",
        "4-KiB",
        "256-KiB",
        "zeros",
        "0xff",
        "http1-get",
        "http1-grpc-post",
        "tls-hello",
        "preface+garbage",
        "preface+huge-frame",
    ],
)
def test_bytes_that_are_not_http2_are_rejected_with_the_connection_closed(target, payload):
    received, closed = send_raw(target.server.running.port, payload, _CLOSE_SECONDS)
    assert closed, f"the server kept the connection open after {payload[:40]!r}"
    if received:
        assert received[3] == _SETTINGS_FRAME_TYPE, received[:16]
    target.assert_serving()


@pytest.mark.parametrize("cut", [1, 10, len(HTTP2_PREFACE) - 1])
def test_a_truncated_preface_does_not_stop_the_server_serving_others(target, cut):
    """A client that stalls mid-preface holds its own connection, nobody else's."""
    stalled = [
        socket.create_connection(("127.0.0.1", target.server.running.port), timeout=2)
        for _ in range(20)
    ]
    try:
        for sock in stalled:
            sock.sendall(HTTP2_PREFACE[:cut])
        target.assert_serving()
    finally:
        for sock in stalled:
            sock.close()
    target.assert_serving()


def test_thousands_of_quick_connects_and_closes_leave_the_server_serving(target):
    port = target.server.running.port
    started = time.monotonic()
    for i in range(3_000):
        with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
            if i % 3 == 1:
                sock.sendall(HTTP2_PREFACE)
            elif i % 3 == 2:
                sock.sendall(_garbage(i, 64))
    elapsed = time.monotonic() - started
    assert elapsed < 30, f"3000 connections took {elapsed:.1f} s"
    target.assert_serving()
