"""Deadlines on the gateway's listener (200 slowloris connections once
stayed open indefinitely): request headers or a body sent too slowly, and connections
idle too long, are closed; the gateway serves others meanwhile."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from .inprocess import LOOPBACK, InProcessGateway, write_model

HEADER_SECONDS, BODY_SECONDS, IDLE_SECONDS = 0.6, 0.6, 0.5


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    started = InProcessGateway(
        write_model(tmp_path_factory.mktemp("timeouts-model")),
        header_timeout_seconds=HEADER_SECONDS,
        body_timeout_seconds=BODY_SECONDS,
        keep_alive_seconds=IDLE_SECONDS,
    )
    yield started
    started.stop()


def connect(gateway: InProcessGateway, first: bytes = b"") -> socket.socket:
    sock = socket.create_connection((LOOPBACK, gateway.port), timeout=5)
    if first:
        sock.sendall(first)
    return sock


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` within `seconds` (reading whatever it answers)."""
    deadline = time.monotonic() + seconds
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if sock.recv(4096) == b"":
                return True
    except TimeoutError:
        return False
    except ConnectionError:
        return True
    return False


def test_200_connections_sending_headers_slowly_are_closed_and_others_are_served(gateway):
    sockets = [
        connect(gateway, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n") for _ in range(200)
    ]
    stop = threading.Event()

    def trickle() -> None:  # a byte now and then: never a whole head
        while not stop.is_set():
            for sock in sockets:
                try:
                    sock.send(b"X")
                except OSError:
                    pass
            stop.wait(0.1)

    trickler = threading.Thread(target=trickle, daemon=True)
    trickler.start()
    try:
        started = time.perf_counter()
        assert gateway.request("GET", "/v1/models").status == 200
        assert time.perf_counter() - started < 2.0
        assert all(closed_within(sock, HEADER_SECONDS + 3.0) for sock in sockets)
    finally:
        stop.set()
        trickler.join(2)
        for sock in sockets:
            sock.close()


def test_a_connection_that_sends_nothing_is_closed(gateway):
    with connect(gateway) as sock:
        assert closed_within(sock, HEADER_SECONDS + 3.0)


def test_a_body_sent_too_slowly_is_closed(gateway):
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"model": '
    )
    with connect(gateway, head) as sock:
        assert closed_within(sock, BODY_SECONDS + 3.0)


def test_an_idle_keep_alive_connection_is_closed_after_its_answer(gateway):
    with connect(gateway, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n") as sock:
        sock.settimeout(5)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        assert closed_within(sock, IDLE_SECONDS + 3.0)
