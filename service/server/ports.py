"""Listening ports: a port already taken is a settings error named in one line (exit 2),
found before anything listens (gRPC would print a line of its own core first, and the
metrics server only "Address already in use", without the port)."""

from __future__ import annotations

import errno
import socket

from prometheus_client import CollectorRegistry

from service.core import ConfigError
from service.server.metrics_http import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_READ_TIMEOUT_SECONDS,
    MetricsHttpServer,
)

_FLAGS = {"port": "--port", "metrics_port": "--metrics-port"}


class PortInUse(ConfigError):
    """Another process listens on a port this server was told to use."""


def _in_use(setting: str, host: str, port: int) -> PortInUse:
    what = "metrics port" if setting == "metrics_port" else "gRPC port"
    return PortInUse(
        f"{what} {port} on {host} is already in use ({_FLAGS[setting]}): stop "
        f"what listens there, or choose another port (0 picks a free one)"
    )


def check_free(setting: str, host: str, port: int) -> None:
    """Raise PortInUse if `port` cannot be bound on `host` because something holds it.

    Binds and closes a probe socket with the options a server uses (SO_REUSEADDR, so a
    port in TIME_WAIT counts as free). Other failures (no such address here) are left to
    the server's own bind, which reports them. Port 0 is always free.
    """
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(
            host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
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


def start_metrics_http(
    host: str,
    port: int,
    registry: CollectorRegistry,
    *,
    read_timeout_seconds: float = DEFAULT_READ_TIMEOUT_SECONDS,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
) -> MetricsHttpServer:
    """The registry's /metrics on host:port, served from a loop on a thread of its own
    (service/server/metrics_http.py); PortInUse names the port if taken."""
    check_free("metrics_port", host, port)
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(max_connections)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise _in_use("metrics_port", host, port) from None
        raise
    sock.setblocking(False)
    return MetricsHttpServer(
        sock, registry, read_timeout_seconds=read_timeout_seconds, max_connections=max_connections
    )
