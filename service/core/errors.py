"""Domain errors of the scheduling core.

Each maps to one gRPC status code in service/server/status_codes.py; the message names the
field and the limit, so a person can act on it.
"""

from common.errors import ConfigError  # noqa: F401  (re-exported: settings errors of the core)


class SchedulerError(Exception):
    """Base of every error the core raises on purpose."""


class InvalidArgument(SchedulerError):
    """The request is malformed or breaks a limit (INVALID_ARGUMENT)."""


class NotFound(SchedulerError):
    """No such sequence (NOT_FOUND)."""

    @classmethod
    def seq_id(cls, seq_id: int) -> "NotFound":
        """The one error for an id that is unknown, or another principal's: the answer
        says nothing of whether it exists."""
        return cls(f"seq_id {seq_id} is unknown (never submitted, or long finished)")


class QueueFull(SchedulerError):
    """The admission queue is at its limit (RESOURCE_EXHAUSTED)."""


class DeadlineUnreachable(QueueFull):
    """A sheddable request (negative priority) that no worker could start before its TTFT
    deadline (RESOURCE_EXHAUSTED, as a full queue: the client may go elsewhere)."""


class UnknownWorker(SchedulerError):
    """The worker is not registered, or its lease expired (FAILED_PRECONDITION)."""


class Superseded(SchedulerError):
    """A call names an older incarnation of a registered worker (FAILED_PRECONDITION); the
    message starts with "superseded:" so that a worker tells it from UnknownWorker."""
