"""The scheduler's metrics endpoint under a flood of half-open connections (200
half-sent requests held 200 threads, and a scrape took 4.1 s): no thread
per connection, a scrape answered at once, and connections that send no full request
head closed after the read timeout."""

from __future__ import annotations

import gzip
import socket
import threading
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from service.server.ports import start_metrics_http

LOOPBACK = "127.0.0.1"
HALF_SENT = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"  # no blank line: the head never ends


def start_endpoint(read_timeout_seconds: float = 1.0):
    registry = CollectorRegistry()
    Counter("probe_requests", "requests seen", registry=registry).inc(3)
    return start_metrics_http(
        LOOPBACK, 0, registry, read_timeout_seconds=read_timeout_seconds, max_connections=300
    )


@pytest.fixture
def endpoint():
    server = start_endpoint()
    yield server
    server.shutdown()


@pytest.fixture
def patient_endpoint():
    # Opening 200 connections on a loaded machine can take longer than 1 s: a read timeout
    # that short would close the first ones before they are counted.
    server = start_endpoint(read_timeout_seconds=4.0)
    yield server
    server.shutdown()
    server.server_close()


def scrape(port: int, headers: dict[str, str] | None = None, timeout: float = 5.0):
    request = urllib.request.Request(f"http://{LOOPBACK}:{port}/metrics", headers=headers or {})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.headers, response.read()


def half_open(port: int, count: int) -> list[socket.socket]:
    sockets = []
    for _ in range(count):
        sock = socket.create_connection((LOOPBACK, port), timeout=5)
        sock.sendall(HALF_SENT)
        sockets.append(sock)
    return sockets


def closed_by_server(sock: socket.socket, within_seconds: float) -> bool:
    sock.settimeout(within_seconds)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionError:
        return True


def test_the_endpoint_answers_as_prometheus_client_would(endpoint):
    headers, body = scrape(endpoint.server_port)
    assert b"probe_requests_total 3.0" in body
    assert headers["Content-Type"].startswith("text/plain")
    headers, body = scrape(
        endpoint.server_port, {"Accept-Encoding": "gzip", "Accept": "application/openmetrics-text"}
    )
    assert headers["Content-Encoding"] == "gzip"
    assert b"# EOF" in gzip.decompress(body)


def test_half_open_connections_take_no_threads_and_do_not_delay_a_scrape(patient_endpoint):
    endpoint = patient_endpoint
    threads_before = threading.active_count()
    sockets = half_open(endpoint.server_port, 200)
    try:
        started = time.perf_counter()
        _, body = scrape(endpoint.server_port)
        scrape_seconds = time.perf_counter() - started
        assert b"probe_requests_total" in body
        assert scrape_seconds < 0.5, f"a scrape took {scrape_seconds:.2f} s behind 200 half-open"
        assert threading.active_count() <= threads_before + 2
        deadline = time.monotonic() + 5.0  # accepted as the loop gets to them
        while endpoint.num_open < 190 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert endpoint.num_open >= 190, "each half-open connection waits, none refused"
        # The read timeout (4 s here) closes each of them.
        assert all(closed_by_server(sock, within_seconds=8.0) for sock in sockets)
    finally:
        for sock in sockets:
            sock.close()


def test_beyond_max_connections_the_oldest_half_open_one_is_closed(endpoint):
    sockets = half_open(endpoint.server_port, 300)
    try:
        newest = half_open(endpoint.server_port, 1)[0]
        assert closed_by_server(sockets[0], within_seconds=0.8), "the oldest made room"
        _, body = scrape(endpoint.server_port, timeout=2.0)  # the cap never refuses a scrape
        assert b"probe_requests_total" in body
        newest.close()
    finally:
        for sock in sockets:
            sock.close()
