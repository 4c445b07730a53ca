"""A small HTTP router in front of plain `vllm serve` processes: what routers do when each
vLLM server schedules itself (the baselines of bench/vllm.py).

- `round-robin`: each request to the next server.
- `prefix-load`: the simulator's rule for prefix-aware routing: a request goes to the
  server that last served the longest prefix it shares (here: the same opening of its
  conversation, the first `prefix_chars` characters of its first message), unless that
  server has more than `max_imbalance` requests in flight beyond the least loaded one;
  otherwise, and for a new prefix, to the least loaded server.

Standard library only: one thread per request, the answer streamed back as it comes.
"""

from __future__ import annotations

import http.client
import itertools
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from common.processes import LOOPBACK


class Router:
    """Picks a backend for each request and counts what is in flight."""

    def __init__(
        self, backends: list[int], rule: str, prefix_chars: int = 200, max_imbalance: int = 2
    ):
        if rule not in ("round-robin", "prefix-load"):
            raise ValueError(f"unknown rule {rule!r}")
        self.backends, self.rule = backends, rule
        self._prefix_chars, self._max_imbalance = prefix_chars, max_imbalance
        self._turn = itertools.cycle(range(len(backends)))
        self._in_flight = [0] * len(backends)
        self._owner: dict[str, int] = {}
        self._lock = threading.Lock()

    def pick(self, body: bytes) -> int:
        with self._lock:
            if self.rule == "round-robin":
                index = next(self._turn)
            else:
                index = self._prefix_load(_prefix_of(body, self._prefix_chars))
            self._in_flight[index] += 1
            return index

    def done(self, index: int) -> None:
        with self._lock:
            self._in_flight[index] -= 1

    def _prefix_load(self, prefix: str) -> int:
        least = min(range(len(self.backends)), key=self._in_flight.__getitem__)
        owner = self._owner.get(prefix)
        if owner is None or (self._in_flight[owner] > self._in_flight[least] + self._max_imbalance):
            owner = least
        self._owner[prefix] = owner
        return owner


def _prefix_of(body: bytes, num_chars: int) -> str:
    try:
        request = json.loads(body)
    except ValueError:
        return ""
    if "messages" in request and request["messages"]:
        return str(request["messages"][0].get("content", ""))[:num_chars]
    return str(request.get("prompt", ""))[:num_chars]


def serve(router: Router, port: int = 0) -> ThreadingHTTPServer:
    """Start the router on loopback (its port: server.server_address[1])."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            self._forward(b"")

        def do_POST(self) -> None:
            self._forward(self.rfile.read(int(self.headers.get("Content-Length", 0))))

        def _forward(self, body: bytes) -> None:
            index = router.pick(body)
            try:
                upstream = http.client.HTTPConnection(LOOPBACK, router.backends[index], timeout=600)
                headers = {"Content-Type": self.headers.get("Content-Type", "application/json")}
                upstream.request(self.command, self.path, body or None, headers)
                response = upstream.getresponse()
                self.send_response(response.status)
                self.send_header("Content-Type", response.getheader("Content-Type", ""))
                self.end_headers()
                while chunk := response.read1(65536):
                    self.wfile.write(chunk)
                    self.wfile.flush()
                upstream.close()
            finally:
                router.done(index)

    server = ThreadingHTTPServer((LOOPBACK, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
