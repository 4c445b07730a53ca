"""Listening ports: a port already taken is a settings error named in one line (exit 2),
found before anything listens (gRPC would print a line of its own core first, and the
metrics server only "Address already in use", without the port)."""
from __future__ import annotations

import errno
import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from service.core import ConfigError

_FLAGS = {"port": "--port", "metrics_port": "--metrics-port"}


class PortInUse(ConfigError):
    """Another process listens on a port this server was told to use."""


def _in_use(setting: str, host: str, port: int) -> PortInUse:
    what = "metrics port" if setting == "metrics_port" else "gRPC port"
    return PortInUse(f"{what} {port} on {host} is already in use ({_FLAGS[setting]}): stop "
                     f"what listens there, or choose another port (0 picks a free one)")


def check_free(setting: str, host: str, port: int) -> None:
    """Raise PortInUse if `port` cannot be bound on `host` because something holds it.

    Binds and closes a probe socket with the options a server uses (SO_REUSEADDR, so a
    port in TIME_WAIT counts as free). Other failures (no such address here) are left to
    the server's own bind, which reports them. Port 0 is always free.
    """
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host.strip("[]") or None, port,
                                       type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    raise _in_use(setting, host, port) from None


def start_metrics_http(host: str, port: int, registry: CollectorRegistry):
    """prometheus_client's WSGI app on host:port, on a thread; PortInUse names the port if
    taken. Its `shutdown()` returns within 50 ms (prometheus_client's start_http_server
    polls for it every 0.5 s, which every stop of the server waited for)."""
    check_free("metrics_port", host, port)
    try:
        server = make_server(host, port, make_wsgi_app(registry), _server_class(host, port),
                             handler_class=_QuietHandler)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise _in_use("metrics_port", host, port) from None
        raise
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                     name="metrics-http", daemon=True).start()
    return server


def _server_class(host: str, port: int) -> type[ThreadingWSGIServer]:
    """ThreadingWSGIServer in the address family of `host` (IPv4 or IPv6)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                flags=socket.AI_PASSIVE)[0][0]
    return type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        """Nothing per request on stderr (scrapes come every few seconds)."""
