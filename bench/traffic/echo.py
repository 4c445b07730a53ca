"""The floor of the traffic benchmarks: a servicer that decides nothing (`echo-server`,
started as its own process by `start_echo`)."""

from __future__ import annotations

import asyncio
import re
import sys

import grpc

from bench.harness.processes import Proc
from common.processes import LOOPBACK
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc

ECHO_LISTENING = re.compile(r"echo listening on (\d+)")


class EchoServicer(pb_grpc.SchedulerServicer):
    """The floor: answers each report with a decision naming its running ids, nothing else.

    `new_form`: its registration says it takes packed tokens and unchanged running lists
    (as the scheduler's does), and a report that leaves its list out gets
    `decode_all_running`, so that the reports and answers are the project's worker's."""

    def __init__(self, new_form: bool = False) -> None:
        self._new_form = new_form

    @staticmethod
    def _answer(request: pb.SelectBatchRequest) -> pb.SchedulerDecision:
        if request.running_unchanged_since and not request.running:
            return pb.SchedulerDecision(decode_all_running=True, iteration=1)
        return pb.SchedulerDecision(decode=request.running, iteration=1)

    async def SelectBatch(self, request, context):
        return self._answer(request)

    async def WorkerSession(self, request_iterator, context):
        async for request in request_iterator:
            yield self._answer(request)

    async def RegisterWorker(self, request, context):
        return pb.RegisterWorkerResponse(
            max_batch_size=request.max_batch_size,
            accepts_token_runs=self._new_form,
            accepts_running_unchanged=self._new_form,
        )


def _echo_interceptors(which: str, tokens_path: str | None) -> list:
    """The interceptors the scheduler's main port has (service/server/app.py): `default`
    (decode errors, stream limits) or `auth` (the bearer-token check between them)."""
    if which == "none":
        return []
    from service.server.interceptors import auth, decode_errors, limits

    first = [decode_errors.DecodeErrorInterceptor()]
    if which == "auth":
        first.append(auth.AuthInterceptor(auth.load_tokens(tokens_path)))
    return [*first, limits.StreamLimitInterceptor(max_streams=10_000, max_open_streams=1000)]


async def _echo_server(port: int, new_form: bool, interceptors: list) -> None:
    server = grpc.aio.server(interceptors=interceptors)
    pb_grpc.add_SchedulerServicer_to_server(EchoServicer(new_form), server)
    bound = server.add_insecure_port(f"{LOOPBACK}:{port}")
    await server.start()
    print(f"echo listening on {bound}", flush=True)
    await server.wait_for_termination()


def cmd_echo_server(args) -> None:
    asyncio.run(
        _echo_server(args.port, args.new_form, _echo_interceptors(args.interceptors, args.tokens))
    )


def start_echo(*flags: str) -> tuple[Proc, str]:
    """A bare echo servicer process (`echo-server` with `flags`) and its target."""
    proc = Proc([sys.executable, "-m", "bench.traffic", "echo-server", *flags])
    return proc, f"{LOOPBACK}:{proc.wait_listening(ECHO_LISTENING).group(1)}"
