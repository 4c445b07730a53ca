"""The one place where domain errors become gRPC status codes."""
from __future__ import annotations

import grpc

from service.core import InvalidArgument, NotFound, QueueFull, SchedulerError, UnknownWorker
from service.core.store import StoreError

_CODES: dict[type[SchedulerError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    UnknownWorker: grpc.StatusCode.FAILED_PRECONDITION,
    StoreError: grpc.StatusCode.UNAVAILABLE,  # nothing was acknowledged: retry
}


def status_code(error: SchedulerError) -> grpc.StatusCode:
    """The status code for a domain error (INTERNAL for one this table does not know)."""
    for cls in type(error).__mro__:
        if cls in _CODES:
            return _CODES[cls]
    return grpc.StatusCode.INTERNAL
