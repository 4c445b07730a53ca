"""Errors as the OpenAI API returns them: an HTTP status and `{"error": {...}}`.

Every failure a request can meet becomes one `GatewayError`; scheduler status codes map to
HTTP statuses in one place (`from_grpc`).
"""

from __future__ import annotations

import grpc

# The error `type` OpenAI clients see for each status.
_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    409: "conflict_error",
    429: "rate_limit_error",
    499: "client_closed_request",
}


class GatewayError(Exception):
    """A request that fails with `status` and a message a person can act on.

    `retryable` False tells OpenAI clients (the x-should-retry header) that a retry cannot
    help; None leaves it to their own rules. (Not a frozen dataclass: exceptions get
    attributes set on them while they propagate.)
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retryable: bool | None = None,
        scheduler_went_away: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retryable = retryable
        # The scheduler could not be reached, or ended a stream unfinished: it may be
        # restarting, and a keyed sequence can be re-attached once it is back.
        self.scheduler_went_away = scheduler_went_away

    def body(self) -> dict:
        kind = _TYPES.get(
            self.status, "server_error" if self.status >= 500 else "invalid_request_error"
        )
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }

    def headers(self) -> dict[str, str]:
        headers = {"www-authenticate": "Bearer"} if self.status == 401 else {}
        if self.retryable is not None:
            headers["x-should-retry"] = "true" if self.retryable else "false"
        return headers


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param)


# Scheduler status -> (HTTP status, what it means to the caller of the gateway).
_FROM_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "the scheduler refused the request"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "the scheduler refused the request"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "the scheduler is full; retry later"),
    grpc.StatusCode.UNAVAILABLE: (503, "the scheduler is unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "the scheduler did not answer in time"),
    grpc.StatusCode.UNAUTHENTICATED: (
        502,
        "the scheduler refused the gateway's credentials (check the gateway's --token)",
    ),
    grpc.StatusCode.PERMISSION_DENIED: (
        502,
        "the scheduler refused the gateway's credentials (its token needs the client role)",
    ),
}


def from_grpc(err: grpc.RpcError, target: str) -> GatewayError:
    """The HTTP error for a failed scheduler call to `target`."""
    code = err.code()
    status, meaning = _FROM_GRPC.get(code, (502, "the scheduler call failed"))
    details = err.details() or code.name
    if code == grpc.StatusCode.UNAVAILABLE:
        meaning = f"cannot reach the scheduler at {target}"
    return GatewayError(
        status,
        f"{meaning}: {code.name}: {details}",
        code=code.name.lower(),
        scheduler_went_away=code == grpc.StatusCode.UNAVAILABLE,
    )
