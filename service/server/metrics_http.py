"""The scheduler's Prometheus endpoint: an asyncio HTTP server on a thread of its own.

prometheus_client's server (ThreadingWSGIServer) spends a thread per connection and
waits without limit for a request's bytes: 200 half-sent requests held 200 threads, and a
scrape behind them took seconds. Here every connection is a
coroutine on one loop; its request head must arrive within `read_timeout_seconds`, and
at most `max_connections` are open (a new one closes the one waiting longest for its
head), so a flood of half-open connections takes no threads and a scrape is answered at
once. GET or HEAD on any path answers the registry as prometheus_client would (text or
OpenMetrics by Accept, gzip when asked, `name[]` filters); each answer closes its
connection.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import socket
import threading
from collections import OrderedDict
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder, gzip_accepted

log = logging.getLogger(__name__)

DEFAULT_READ_TIMEOUT_SECONDS = 5.0
DEFAULT_MAX_CONNECTIONS = 512
MAX_HEAD_BYTES = 16384


class MetricsHttpServer:
    """Serves `registry` on the bound, listening `sock` until `shutdown()`."""

    def __init__(
        self,
        sock: socket.socket,
        registry: CollectorRegistry,
        *,
        read_timeout_seconds: float = DEFAULT_READ_TIMEOUT_SECONDS,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        self._sock = sock
        self._registry = registry
        self._read_timeout_seconds = read_timeout_seconds
        self._max_connections = max_connections
        # Connections still waiting for their request head, oldest first.
        self._waiting: OrderedDict[asyncio.StreamWriter, None] = OrderedDict()
        self._num_open = 0
        self._loop = asyncio.new_event_loop()
        self._stopped = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-http", daemon=True)
        self._thread.start()
        self._ready.wait(5.0)

    @property
    def server_port(self) -> int:
        return self._sock.getsockname()[1]

    @property
    def num_open(self) -> int:
        """Connections open now (for tests and figures)."""
        return self._num_open

    def shutdown(self) -> None:
        """Stop serving; returns once the loop has stopped."""
        if not self._stopped.is_set():
            self._stopped.set()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)

    def server_close(self) -> None:
        self._sock.close()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, sock=self._sock, limit=MAX_HEAD_BYTES)
        )
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._num_open += 1
        if self._num_open > self._max_connections and self._waiting:
            oldest, _ = self._waiting.popitem(last=False)
            oldest.close()
        self._waiting[writer] = None
        try:
            try:
                head = await asyncio.wait_for(
                    reader.readuntil(b"\r\n\r\n"), self._read_timeout_seconds
                )
            except (
                TimeoutError,
                asyncio.IncompleteReadError,
                asyncio.LimitOverrunError,
                ConnectionError,
                OSError,
            ):
                return  # too slow, too long, or gone: nothing to answer
            finally:
                self._waiting.pop(writer, None)
            writer.write(self._answer(head))
            await asyncio.wait_for(writer.drain(), self._read_timeout_seconds)
        except (TimeoutError, ConnectionError, OSError):
            pass
        except asyncio.CancelledError:
            pass  # the endpoint is stopping (its own loop: nothing else cancels)
        except Exception:  # one bad request must not stop the endpoint
            log.exception("the metrics endpoint failed to answer a request")
        finally:
            self._num_open -= 1
            writer.close()

    def _answer(self, head: bytes) -> bytes:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            return _response("400 Bad Request", "text/plain", b"bad request line\n")
        method, target, _ = parts
        if method not in ("GET", "HEAD"):
            return _response("405 Method Not Allowed", "text/plain", b"GET only\n")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        _, _, query = target.partition("?")
        params = parse_qs(query)
        registry = self._registry
        if "name[]" in params:
            registry = registry.restricted_registry(params["name[]"])
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        body = encoder(registry)
        extra = []
        if gzip_accepted(headers.get("accept-encoding", "")):
            body = gzip.compress(body)
            extra.append("Content-Encoding: gzip")
        return _response("200 OK", content_type, body, extra, send_body=method == "GET")


def _response(
    status: str,
    content_type: str,
    body: bytes,
    extra: list[str] | None = None,
    send_body: bool = True,
) -> bytes:
    head = [
        f"HTTP/1.1 {status}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(extra or []),
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (body if send_body else b"")
