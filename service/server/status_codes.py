"""The one place where domain errors become gRPC status codes."""

from __future__ import annotations

import grpc

from service.core import (
    InvalidArgument,
    NotFound,
    QueueFull,
    SchedulerError,
    Superseded,
    UnknownWorker,
)
from service.core.persist.store import StoreError

_CODES: dict[type[SchedulerError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    UnknownWorker: grpc.StatusCode.FAILED_PRECONDITION,
    Superseded: grpc.StatusCode.FAILED_PRECONDITION,  # message starts "superseded:"
    StoreError: grpc.StatusCode.UNAVAILABLE,  # nothing was acknowledged: retry
}


# Status details travel in a trailer that peers cap (grpc: 8 KiB soft, 16 KiB hard, after
# percent-encoding: up to 12 bytes a character). A message quoting a huge request field
# would otherwise reach the client as RESOURCE_EXHAUSTED instead of its real status.
MAX_DETAILS_CHARS = 500


def status_details(error: SchedulerError) -> str:
    """The error's message, cut to MAX_DETAILS_CHARS."""
    message = str(error)
    if len(message) <= MAX_DETAILS_CHARS:
        return message
    return message[: MAX_DETAILS_CHARS - 20] + f"... ({len(message)} chars)"


def status_code(error: SchedulerError) -> grpc.StatusCode:
    """The status code for a domain error (INTERNAL for one this table does not know)."""
    for cls in type(error).__mro__:
        if cls in _CODES:
            return _CODES[cls]
    return grpc.StatusCode.INTERNAL
