"""The client subcommands of `lattice-scheduler` (submit, generate, cancel, status, drain)."""

from __future__ import annotations

import argparse
import json
import random
import re
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.credentials import client_args_credentials, open_channel
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from service.core import ConfigError

# gRPC's reason for a failed connection: "... last error: CODE: ipv4:HOST:PORT: <reason>".
_LAST_ERROR = re.compile(r"last error: [A-Z_]+: (?:ipv[46]:\S+: )?(.+?)(?:: OK)?$")
# Random prompts stay below this id so that they fit any model's vocabulary, tiny included.
RANDOM_TOKEN_ID_LIMIT = 200


class CommandError(Exception):
    """A failure to report in one line, without a traceback."""


def _channel(args: argparse.Namespace) -> grpc.Channel:
    """A channel to --target, with the TLS and token flags applied, that a scheduler answered on.

    Fails fast: a refused connection or failed handshake is reported at once, not after
    --timeout (only an address that never answers takes the whole --timeout).
    """
    try:
        channel = open_channel(args.target, client_args_credentials(args), args.token)
    except ConfigError as err:
        raise CommandError(str(err)) from None
    try:
        # Health is open to every caller (no token), and without wait_for_ready a call
        # fails as soon as the connection does.
        health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=args.timeout
        )
    except grpc.RpcError as err:
        if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return channel  # something answered; the command's own call says what is wrong
        channel.close()
        raise CommandError(_unreachable(args, err)) from None
    return channel


def _unreachable(args: argparse.Namespace, err: grpc.RpcError) -> str:
    """One line: the target, why the connection failed, and a TLS hint when it may help."""
    tls_may_be_why = False  # a connection was made, then failed (closed, reset, handshake)
    if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        reason = f"no answer within {args.timeout:g} s"
    else:
        match = _LAST_ERROR.search(err.details() or "")
        reason = match.group(1) if match else (err.details() or "unavailable")
        if reason.lower().endswith("connection refused"):
            reason = "connection refused"
        tls_may_be_why = match is not None and reason != "connection refused"
    hint = (
        "; a TLS scheduler needs --tls-ca, an mTLS one also --tls-cert/--tls-key"
        if tls_may_be_why and args.tls_ca is None
        else ""
    )
    return f"cannot reach the scheduler at {args.target} ({reason}{hint})"


def _stub(args: argparse.Namespace) -> pb_grpc.SchedulerStub:
    return pb_grpc.SchedulerStub(_channel(args))


def _rpc_error(err: grpc.RpcError) -> CommandError:
    return CommandError(f"{err.code().name}: {err.details()}")


def _request(args: argparse.Namespace, rng: random.Random, index: int = 0) -> pb.SubmitRequest:
    """The SubmitRequest of args (their values were checked as they were parsed)."""
    if args.prompt_ids:
        prompt = list(args.prompt_ids)
    else:
        prompt = [rng.randrange(1, RANDOM_TOKEN_ID_LIMIT) for _ in range(args.prompt_len)]
    request_id = f"{args.request_id}-{index}" if args.request_id and index else args.request_id
    return pb.SubmitRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        max_new_tokens=args.max_new_tokens,
        sampling=pb.SamplingParams(temperature=args.temperature, seed=args.seed),
    )


def submit(args: argparse.Namespace) -> int:
    stub = _stub(args)
    rng = random.Random(args.seed)
    for index in range(args.count):
        resp = stub.Submit(_request(args, rng, index), timeout=args.timeout)
        print(f"seq_id={resp.seq_id} queue_position={resp.queue_position}")
    return 0


def generate(args: argparse.Namespace) -> int:
    stub = _stub(args)
    tokens: list[int] = []
    if not stub.GetStatus(pb.GetStatusRequest(), timeout=args.timeout).workers:
        print(
            "note: no worker is registered; the sequence waits in the queue until one "
            "joins (Ctrl-C cancels it)",
            file=sys.stderr,
            flush=True,
        )
    for event in stub.Generate(
        _request(args, random.Random(args.seed)), timeout=args.stream_timeout
    ):
        if not tokens and not event.token_ids and not event.finished:
            print(f"seq_id={event.seq_id}", flush=True)
        tokens.extend(event.token_ids)
        if event.token_ids:
            print(" ".join(map(str, event.token_ids)), flush=True)
        if event.finished:
            reason = pb.FinishReason.Name(event.finish_reason)
            why = f": {event.error_message}" if event.error_message else ""
            print(f"finished: {reason} after {len(tokens)} tokens{why}", flush=True)
    return 0


def cancel(args: argparse.Namespace) -> int:
    stub = _stub(args)
    for seq_id in args.seq_ids:
        resp = stub.Cancel(pb.CancelRequest(seq_id=seq_id), timeout=args.timeout)
        print(f"seq_id={seq_id} cancelled={str(resp.cancelled).lower()}")
    return 0


def status(args: argparse.Namespace) -> int:
    stub = _stub(args)
    if args.seq_ids:
        for seq_id in args.seq_ids:
            info = stub.GetSequence(pb.GetSequenceRequest(seq_id=seq_id), timeout=args.timeout)
            print(
                f"seq_id={info.seq_id} state={pb.SequenceState.Name(info.state)} "
                f"worker={info.worker_id or '-'} prompt_len={info.prompt_len} "
                f"prefilled={info.prefilled_tokens} generated={info.generated_tokens} "
                f"queue_position={info.queue_position} "
                f"finish_reason={pb.FinishReason.Name(info.finish_reason)}"
                + (f" error={json.dumps(info.error_message)}" if info.error_message else "")
            )
        return 0
    st = stub.GetStatus(pb.GetStatusRequest(), timeout=args.timeout)
    print(
        f"policy={st.policy} queue_depth={st.queue_depth} assigned={st.num_assigned} "
        f"workers={len(st.workers)}"
    )
    for w in st.workers:
        print(
            f"  worker={w.worker_id} assigned={w.num_assigned} "
            f"kv_free={w.kv_free_pages}/{w.total_kv_pages} "
            f"gdn_free={w.gdn_free_slots}/{w.total_gdn_slots} iteration={w.iteration} "
            f"draining={str(w.draining).lower()} incarnation={w.incarnation} "
            f"last_call={w.seconds_since_last_call:.1f}s ago"
        )
    return 0


def drain(args: argparse.Namespace) -> int:
    resp = _stub(args).DrainWorker(
        pb.DrainWorkerRequest(worker_id=args.worker_id, resume=args.resume), timeout=args.timeout
    )
    state = "lifted (admits again)" if args.resume else "requested (admits nothing new)"
    print(f"worker={args.worker_id} drain {state}; sequences still on it: {resp.num_assigned}")
    return 0


def load(args: argparse.Namespace) -> int:
    from common.loadgen import LoadSpec, run_load

    channel = _channel(args)  # fail fast, with a clear message, when nothing answers
    spec = LoadSpec(
        num_requests=args.requests,
        concurrency=args.concurrency,
        min_prompt_len=args.min_prompt_len,
        max_prompt_len=args.max_prompt_len,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
    )
    print(
        f"load: {spec.num_requests} Generate streams, {spec.concurrency} at a time, prompts "
        f"{spec.min_prompt_len}-{spec.max_prompt_len} tokens, {spec.max_new_tokens} new tokens "
        f"each, against {args.target}",
        flush=True,
    )
    report = run_load(args.target, spec, channel=channel)
    channel.close()
    for line in report.lines():
        print(line, flush=True)
    return 0 if len(report.ok) == len(report.results) else 1


COMMANDS = {
    "submit": submit,
    "generate": generate,
    "cancel": cancel,
    "status": status,
    "load": load,
    "drain": drain,
}


def run(command: str, args: argparse.Namespace) -> int:
    """Run one client command; a failed call becomes one CommandError line."""
    try:
        return COMMANDS[command](args)
    except grpc.RpcError as err:
        raise _rpc_error(err) from None
