"""A live scheduler under fuzzing: call any RPC, record the status, check health."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lattice.scheduler.v1 import scheduler_pb2 as pb
from tests.server.conftest import Server
from tests.server.wire import RPC_TIMEOUT_SECONDS
from worker_client.session import WorkerSessionStream

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Scheduler"].full_name
# Request-response RPCs (Generate streams its answer but takes one request); the
# bidirectional WorkerSession is fuzzed by test_session_fuzz.py, through `session_calls`.
METHODS = tuple(
    m.name for m in pb.DESCRIPTOR.services_by_name["Scheduler"].methods if not m.client_streaming
)
# What the service may answer to any request it could parse; never UNKNOWN or INTERNAL.
EXPECTED_CODES = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)
# Response streams, read up to their first event, within this many seconds. Generate's
# first event (the seq_id) comes at once; FollowSequence's comes with the sequence's first
# tokens, so a follow that is still open when its deadline ends is waiting (`waiting`).
STREAMED = {"Generate": RPC_TIMEOUT_SECONDS, "FollowSequence": 0.5}


def waiting(method: str, code: grpc.StatusCode) -> bool:
    """Whether a stream of `method` that ended `code` was open, waiting for its first event."""
    return method == "FollowSequence" and code is grpc.StatusCode.DEADLINE_EXCEEDED


# Longer status details than this mean a request field was echoed without a bound.
DETAILS_BOUND_CHARS = 1000
# Ids the request strategies pick from: the latest ones issued and the ones held.
_RECENT_IDS = 32


@dataclass
class Outcome:
    """How one call ended: its status, the response (None unless OK) and the details."""

    code: grpc.StatusCode
    response: object = None
    details: str = ""


@dataclass
class FuzzTarget:
    """A running scheduler, the ids it issued and what the fuzz workers hold.

    `codes` counts (method, status name) over every call made through `call`.
    """

    server: Server
    codes: Counter
    state_dir: str = ""
    issued: list[int] = field(default_factory=list)
    held: dict[str, list[int]] = field(default_factory=dict)

    def known_ids(self) -> list[int]:
        """Ids worth naming in a request: recently issued, or held by a worker."""
        held = [s for ids in self.held.values() for s in ids]
        return list(dict.fromkeys([*held, *self.issued[-_RECENT_IDS:]]))

    def __repr__(self) -> str:  # hypothesis prints it with every failing example
        return f"FuzzTarget({self.server.target}, {len(self.issued)} ids issued)"

    def call(self, method: str, request) -> Outcome:
        """Make one call, bounded by RPC_TIMEOUT_SECONDS; a response stream is read up to
        its first event and then cancelled (`STREAMED`)."""
        try:
            if method in STREAMED:
                timeout = STREAMED[method]
                stream = getattr(self.server.stub, method)(request, timeout=timeout)
                try:
                    outcome = Outcome(grpc.StatusCode.OK, next(stream))
                except grpc.RpcError as err:
                    if not waiting(method, err.code()):
                        raise
                    outcome = Outcome(grpc.StatusCode.OK)  # open, waiting for tokens
                finally:
                    stream.cancel()
            else:
                rpc = getattr(self.server.stub, method)
                outcome = Outcome(grpc.StatusCode.OK, rpc(request, timeout=RPC_TIMEOUT_SECONDS))
        except grpc.RpcError as err:
            outcome = Outcome(err.code(), None, err.details() or "")
        self.codes[method, outcome.code.name] += 1
        self._remember(method, request, outcome.response)
        return outcome

    def session_calls(self, requests: list) -> list[Outcome]:
        """Send `requests` over WorkerSession streams, one at a time: an answer is OK; an
        error ends the stream (its outcome), and the next request opens a new one."""
        outcomes, session = [], None
        try:
            for request in requests:
                session = session or WorkerSessionStream(self.server.stub)
                try:
                    outcome = Outcome(
                        grpc.StatusCode.OK, session.exchange(request, RPC_TIMEOUT_SECONDS)
                    )
                except grpc.RpcError as err:
                    outcome, session = Outcome(err.code(), None, err.details() or ""), None
                self.codes["WorkerSession", outcome.code.name] += 1
                self._remember("SelectBatch", request, outcome.response)
                outcomes.append(outcome)
        finally:
            if session is not None:
                session.close()
        return outcomes

    def _remember(self, method: str, request, response) -> None:
        if response is None:
            return
        if method in ("Submit", "Generate"):
            self.issued.append(response.seq_id)
        elif method == "SelectBatch":
            held = self.held.setdefault(request.worker_id, [])
            evicted = set(response.evict)
            admitted = [c.seq_id for c in response.prefill if c.HasField("spec")]
            self.held[request.worker_id] = [
                s for s in dict.fromkeys([*held, *admitted]) if s not in evicted
            ][-_RECENT_IDS:]
        elif method in ("RegisterWorker", "DeregisterWorker"):
            self.held.pop(request.worker_id, None)

    def health(self, service: str = SERVICE_NAME) -> int:
        return (
            health_pb2_grpc.HealthStub(self.server.channel)
            .Check(health_pb2.HealthCheckRequest(service=service), timeout=RPC_TIMEOUT_SECONDS)
            .status
        )

    def assert_serving(self) -> None:
        """Health says SERVING, and a plain Submit is accepted."""
        assert self.health("") == health_pb2.HealthCheckResponse.SERVING
        assert self.health() == health_pb2.HealthCheckResponse.SERVING
        outcome = self.call(
            "Submit", pb.SubmitRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=4)
        )
        assert outcome.code is grpc.StatusCode.OK, outcome
