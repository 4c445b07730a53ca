"""The gateway's gRPC client of the scheduler (grpc.aio): Generate streams, Cancel, health.

The only module of the gateway that touches generated code; it hands out the typed
`GenerationRequest` / `TokenEvent` below and raises `GatewayError`s.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.credentials import aio_channel, token_metadata
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from service.gateway.api_keys import PRINCIPAL_METADATA
from service.gateway.errors import GatewayError, from_grpc


class FinishReason(enum.Enum):
    """Why the scheduler ended a sequence."""

    EOS = pb.FINISH_REASON_EOS
    MAX_LENGTH = pb.FINISH_REASON_MAX_LENGTH
    STOP = pb.FINISH_REASON_STOP
    CANCELLED = pb.FINISH_REASON_CANCELLED
    PREEMPTED = pb.FINISH_REASON_PREEMPTED
    FAILED = pb.FINISH_REASON_FAILED


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence to run, as the gateway submits it."""

    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float
    top_p: float  # 0 = off
    top_k: int  # 0 = off
    seed: int
    stop_token_ids: tuple[int, ...]
    tenant: str = ""
    priority: int = 0
    request_id: str = ""  # the scheduler's request_id (service/gateway/idempotency.py); "" = none
    principal: str = ""  # who asked (service/gateway/api_keys.py); "" = anonymous
    scheduler_token: str | None = None  # the principal's own scheduler token; None: the gateway's
    logprobs: int = 0  # alternatives per generated token's logprob; 0 = no logprobs
    prompt_logprobs: int = 0  # the same for the prompt tokens after the first
    ignore_eos: bool = False
    min_new_tokens: int = 0


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability and the most likely tokens at its position."""

    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """Tokens new since the previous event; the last one has `finish_reason` set."""

    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    error_message: str = ""
    # One per token when the sequence asked for logprobs and the scheduler knows them
    # (not for tokens generated before a scheduler restart); else empty.
    logprobs: tuple[TokenLogprob, ...] = ()
    # On the first event with tokens, when asked for: one per prompt token after the first.
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


class GenerateStream:
    """One open Generate call: its seq_id, then its events. `cancel()` cancels the sequence
    (the scheduler cancels a sequence whose Generate caller goes away)."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, seq_id: int, target: str) -> None:
        self._call = call
        self.seq_id = seq_id
        self._target = target

    async def next(self) -> TokenEvent:
        """The next event; GatewayError when the stream breaks before the last one."""
        try:
            event = await self._call.read()
        except grpc.RpcError as err:
            raise from_grpc(err, self._target) from None
        if event is grpc.aio.EOF:
            raise GatewayError(
                502,
                f"the scheduler at {self._target} ended the stream of "
                f"seq_id {self.seq_id} before it finished",
                scheduler_went_away=True,
            )
        reason = FinishReason(event.finish_reason) if event.finished else None
        return TokenEvent(
            tuple(event.token_ids),
            reason,
            event.error_message,
            _logprobs(event.logprobs),
            _logprobs(event.prompt_logprobs),
        )

    def cancel(self) -> None:
        self._call.cancel()


class SchedulerLink:
    """A grpc.aio channel to the scheduler at `target`, with TLS and a token when given."""

    def __init__(
        self,
        target: str,
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
    ) -> None:
        from common.targets import channel_target  # replicas: round robin over a list

        self.target = target
        address, options = channel_target(target)
        self._channel = aio_channel(address, credentials, options)
        self._stub = pb_grpc.SchedulerStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = token_metadata(token)

    def _metadata_for(self, request: GenerationRequest | None) -> tuple:
        """The call's metadata: the principal's scheduler token (else the gateway's), and
        the principal's name."""
        if request is None:
            return self._metadata
        metadata = (
            self._metadata
            if request.scheduler_token is None
            else token_metadata(request.scheduler_token)
        )
        if request.principal:
            metadata = (*metadata, (PRINCIPAL_METADATA, request.principal))
        return tuple(metadata)

    async def generate(self, request: GenerationRequest) -> GenerateStream:
        """Submit (or re-attach to `request_id`'s sequence) and return its open stream."""
        call = self._stub.Generate(_submit_request(request), metadata=self._metadata_for(request))
        try:
            first = await call.read()
        except grpc.RpcError as err:
            raise from_grpc(err, self.target) from None
        if first is grpc.aio.EOF:
            raise GatewayError(
                502,
                f"the scheduler at {self.target} ended a Generate stream before naming its seq_id",
            )
        return GenerateStream(call, first.seq_id, self.target)

    async def cancel(
        self, seq_id: int, request: GenerationRequest | None = None, timeout_seconds: float = 10.0
    ) -> None:
        """Cancel `seq_id`, as the principal of `request` (None: as the gateway)."""
        try:
            await self._stub.Cancel(
                pb.CancelRequest(seq_id=seq_id),
                metadata=self._metadata_for(request),
                timeout=timeout_seconds,
            )
        except grpc.RpcError as err:
            raise from_grpc(err, self.target) from None

    async def check_health(self, timeout_seconds: float = 2.0) -> str | None:
        """None when the scheduler answers SERVING; otherwise why not, in one line."""
        try:
            response = await self._health.Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_seconds
            )
        except grpc.RpcError as err:
            return from_grpc(err, self.target).message
        if response.status != health_pb2.HealthCheckResponse.SERVING:
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
            return f"the scheduler at {self.target} is {status}"
        # Health is open to all; a call the gateway's clients need says whether the
        # scheduler accepts the gateway's credentials (GetStatus: the client role has it).
        try:
            await self._stub.GetStatus(
                pb.GetStatusRequest(), metadata=self._metadata, timeout=timeout_seconds
            )
        except grpc.RpcError as err:
            if err.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                return from_grpc(err, self.target).message
        return None

    async def close(self) -> None:
        await self._channel.close()


def _submit_request(request: GenerationRequest) -> pb.SubmitRequest:
    return pb.SubmitRequest(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        max_new_tokens=request.max_new_tokens,
        priority=request.priority,
        tenant=request.tenant,
        stop_token_ids=request.stop_token_ids,
        sampling=pb.SamplingParams(
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            seed=request.seed,
            logprobs=request.logprobs,
            prompt_logprobs=request.prompt_logprobs,
            ignore_eos=request.ignore_eos,
            min_new_tokens=request.min_new_tokens,
        ),
    )


def _logprobs(entries) -> tuple[TokenLogprob, ...]:
    return tuple(
        TokenLogprob(e.logprob, tuple(e.top_token_ids), tuple(e.top_logprobs)) for e in entries
    )
