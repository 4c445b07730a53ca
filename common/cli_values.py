"""Argument types for the command lines: each value is checked as it is parsed, before any
call, and a bad one is refused in one line naming the flag, the value and what is allowed.

Use them as argparse `type=`; with `OneLineParser` a refusal is one line and exit code 2.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
# Strings a scheduler refuses beyond this many UTF-8 bytes (service.server.convert.MAX_STRING_BYTES).
MAX_STRING_BYTES = 256
# gRPC name-resolver schemes a target may start with instead of HOST:PORT.
_TARGET_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")
_HOST_PORT = re.compile(r"^(?P<host>\[[^\]]+\]|[^:\[\]]+):(?P<port>[^:]*)$")


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (no usage block), exit code 2.
    Sub-parsers made from it are of the same class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def integer(low: int, high: int) -> Callable[[str], int]:
    """An integer within [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low} to {high}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def number(low: float, *, low_open: bool = False) -> Callable[[str], float]:
    """A finite number at least `low` (above it, with low_open)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not math.isfinite(value) or value < low or (low_open and value == low):
            bound = f"above {low:g}" if low_open else f"at least {low:g}"
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


seq_id = integer(1, UINT64_MAX)
seed = integer(0, UINT64_MAX)


def token_ids(text: str) -> tuple[int, ...]:
    """Comma-separated token ids, at least one, each a uint32."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("must hold at least one token id, e.g. 1,2,3")
    ids = []
    for part in parts:
        try:
            value = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be comma-separated integers, got {part!r}"
            ) from None
        if not 0 <= value <= UINT32_MAX:
            raise argparse.ArgumentTypeError(f"token id {value} is outside 0-{UINT32_MAX}")
        ids.append(value)
    return tuple(ids)


def name(what: str, *, allow_empty: bool) -> Callable[[str], str]:
    """A string a scheduler accepts as `what` (worker_id, request_id): within its byte limit."""

    def parse(text: str) -> str:
        if not text and not allow_empty:
            raise argparse.ArgumentTypeError(f"{what} must not be empty")
        num_bytes = len(text.encode("utf-8", "surrogateescape"))
        if num_bytes > MAX_STRING_BYTES:
            raise argparse.ArgumentTypeError(
                f"{what} is {num_bytes} bytes; the limit is {MAX_STRING_BYTES}"
            )
        return text

    parse.__name__ = "name"
    return parse


def target(text: str) -> str:
    """A scheduler address: HOST:PORT ([V6ADDR]:PORT), or a gRPC target with a scheme
    (dns:, unix:, ...), which gRPC checks itself; or replicas' addresses, comma-separated
    (common/targets.py)."""
    if "," in text:
        for entry in text.split(","):
            if entry.strip():
                _one_target(entry.strip())
        return text
    return _one_target(text)


def _one_target(text: str) -> str:
    if text.startswith(_TARGET_SCHEMES):
        return text
    example = "e.g. 127.0.0.1:50051"
    match = _HOST_PORT.match(text)
    if match is None:
        if text and ":" not in text:
            raise argparse.ArgumentTypeError(f"{text!r} has no port: expected HOST:PORT, {example}")
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an address: expected HOST:PORT ([ADDR]:PORT for IPv6), {example}"
        )
    port = match.group("port")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the port must be a number from 1 to 65535, got {port!r}; "
            f"expected HOST:PORT, {example}"
        )
    return text
