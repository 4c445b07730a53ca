"""Scheduler addresses with failover: `HOST:PORT[,HOST:PORT...]` or `dns:///NAME:PORT`.

Clients (`lattice-scheduler submit --target`, the gateway) spread calls over every
replica: one gRPC channel over all the addresses with the round_robin policy, which
sends each call to a connected replica, so a replica that goes away costs only the calls
in flight on it (UNAVAILABLE; the next call goes to another). A DNS name resolving to
several addresses works the same way (gRPC re-resolves it).

Workers stick to one replica (they belong to the replica they talk to) and move to the
next address on UNAVAILABLE: `expand` gives them the list.
"""

from __future__ import annotations

import ipaddress
import socket

from common.errors import ConfigError

ROUND_ROBIN = ("grpc.lb_policy_name", "round_robin")


class TargetError(ConfigError):
    """A target list that cannot be used; the message names the entry."""


def split(target: str) -> list[str]:
    """The entries of a comma-separated list (spaces ignored)."""
    entries = [part.strip() for part in target.split(",") if part.strip()]
    if not entries:
        raise TargetError("no scheduler address given (HOST:PORT[,HOST:PORT...])")
    return entries


def expand(target: str) -> list[str]:
    """Every address of `target`, each HOST:PORT; `dns:///NAME:PORT` entries become one
    entry per address the name resolves to now."""
    out: list[str] = []
    for entry in split(target):
        if entry.startswith("dns:"):
            host, port = _host_port(entry.split("///", 1)[-1].split("/", 1)[-1])
            out.extend(_bracket(ip) + f":{port}" for ip in _resolve(host, port))
        else:
            out.append(entry)
    return out


def channel_target(target: str) -> tuple[str, list[tuple[str, object]]]:
    """(gRPC target, channel options) for a client channel over every replica."""
    entries = split(target)
    if len(entries) == 1:
        return entries[0], ([ROUND_ROBIN] if entries[0].startswith("dns:") else [])
    addresses = []
    for entry in entries:
        host, port = _host_port(entry)
        addresses.extend((ip, port) for ip in _resolve(host, port))
    families = {ipaddress.ip_address(ip).version for ip, _ in addresses}
    if len(families) > 1:
        raise TargetError(f"{target!r} mixes IPv4 and IPv6 addresses; list one family")
    scheme = "ipv4" if families == {4} else "ipv6"
    uri = ",".join(f"{_bracket(ip)}:{port}" for ip, port in addresses)
    return f"{scheme}:{uri}", [ROUND_ROBIN]


def _host_port(entry: str) -> tuple[str, int]:
    host, sep, port = entry.rpartition(":")
    if not sep or not port.isdigit():
        raise TargetError(f"{entry!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def _resolve(host: str, port: int) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise TargetError(f"cannot resolve {host!r}: {err.strerror}") from None
    return list(dict.fromkeys(info[4][0] for info in infos))


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host
