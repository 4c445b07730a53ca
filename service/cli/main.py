"""`lattice-scheduler`: serve, client conveniences (submit, generate, cancel, status), drain,
`state check`, and `simulate`.

Exit codes: 0 done; 1 a call failed (or `state check` found damage); 2 a bad value on the
command line or in the settings (one line, before any call), or a state directory the
scheduler refuses; 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys

from common import cli_values as values
from service.core import ConfigError

_POSITIVE_SECONDS = values.number(0.0, low_open=True)
_AT_LEAST_ONE = values.integer(1, 2**31 - 1)


def main(argv: list[str] | None = None) -> int:
    parser = values.OneLineParser(
        prog="lattice-scheduler",
        description="Iteration-level scheduler for hybrid GDN + attention LLM workers.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    from service import settings  # light: no grpc import

    serve = sub.add_parser(
        "serve",
        help="run the scheduler service",
        description=settings.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    settings.add_arguments(serve)

    for name, help_text in (
        ("submit", "enqueue sequences and print their ids"),
        ("generate", "submit one sequence and print its tokens as they come"),
    ):
        p = sub.add_parser(name, help=help_text)
        _add_target(p)
        p.add_argument(
            "--prompt-ids",
            type=values.token_ids,
            help="comma-separated prompt token ids (each 0 to 2^32-1)",
        )
        p.add_argument(
            "--prompt-len",
            type=_AT_LEAST_ONE,
            default=16,
            help="random prompt of this many tokens when --prompt-ids is absent",
        )
        p.add_argument("--max-new-tokens", type=values.integer(1, values.UINT32_MAX), default=16)
        p.add_argument(
            "--request-id",
            type=values.name("request_id", allow_empty=True),
            default="",
            help="idempotency key",
        )
        p.add_argument(
            "--temperature", type=values.number(0.0), default=0.0, help="0 (the default) is greedy"
        )
        p.add_argument("--seed", type=values.seed, default=0)
        if name == "submit":
            p.add_argument("--count", type=_AT_LEAST_ONE, default=1, help="how many sequences")
        else:
            p.add_argument(
                "--stream-timeout",
                type=_POSITIVE_SECONDS,
                default=600.0,
                help="seconds the whole stream may take (the sequence is "
                "cancelled when it runs out)",
            )

    p = sub.add_parser(
        "load",
        help="a bounded demo load of concurrent Generate streams; "
        "prints progress, then throughput and latency",
    )
    _add_target(p)
    p.add_argument("--requests", type=_AT_LEAST_ONE, default=24)
    p.add_argument("--concurrency", type=_AT_LEAST_ONE, default=8)
    p.add_argument("--min-prompt-len", type=_AT_LEAST_ONE, default=8)
    p.add_argument("--max-prompt-len", type=_AT_LEAST_ONE, default=200)
    p.add_argument("--max-new-tokens", type=values.integer(1, values.UINT32_MAX), default=32)
    p.add_argument("--seed", type=values.seed, default=0)
    load_parser = p

    p = sub.add_parser("cancel", help="cancel sequences")
    _add_target(p)
    p.add_argument("seq_ids", type=values.seq_id, nargs="+", metavar="SEQ_ID")

    p = sub.add_parser("status", help="the scheduler's queue and workers, or given sequences")
    _add_target(p)
    p.add_argument("seq_ids", type=values.seq_id, nargs="*", metavar="SEQ_ID")

    from service.gateway import cli as gateway_cli  # light: no fastapi or grpc import

    p = sub.add_parser(
        "gateway",
        help="an OpenAI-compatible HTTP server in front of the scheduler",
        description=gateway_cli.DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gateway_cli.add_arguments(p)

    p = sub.add_parser(
        "drain",
        help="admin: admit nothing new to a worker while what it "
        "runs finishes (needs an admin token under --auth-tokens)",
    )
    _add_target(p)
    p.add_argument("worker_id", type=values.name("worker_id", allow_empty=False))
    p.add_argument("--resume", action="store_true", help="lift an earlier drain instead")

    state = sub.add_parser("state", help="work on a --state-dir offline")
    state_sub = state.add_subparsers(dest="state_command", required=True)
    p = state_sub.add_parser(
        "check",
        help="verify a state directory as a starting scheduler would (every row's "
        "checksum, every row decoded) without changing it; exit 0 sound, "
        "1 damaged, 2 not checkable (no such directory, or in use)",
    )
    p.add_argument("state_dir", metavar="DIR")

    from service.sim import cli as sim_cli

    sim_cli.add_parser(sub)

    args = parser.parse_args(argv)
    if args.command == "load" and args.max_prompt_len < args.min_prompt_len:
        load_parser.error(
            f"argument --max-prompt-len: must be at least --min-prompt-len "
            f"({args.min_prompt_len}), got {args.max_prompt_len}"
        )
    if args.command == "serve":
        return _serve(args)
    if args.command == "simulate":
        return sim_cli.run(args)
    if args.command == "gateway":
        return gateway_cli.main(args)
    if args.command == "state":
        return _state_check(args.state_dir)
    from service.cli import client_commands

    try:
        return client_commands.run(args.command, args)
    except client_commands.CommandError as err:
        print(f"lattice-scheduler {args.command}: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"lattice-scheduler {args.command}: interrupted", file=sys.stderr)
        return 130


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target",
        type=values.target,
        default=os.environ.get("LATTICE_SCHEDULER_TARGET", "127.0.0.1:50051"),
        help="scheduler address HOST:PORT, or replicas HOST:PORT,HOST:PORT or "
        "dns:///NAME:PORT (calls go to those up; env "
        "LATTICE_SCHEDULER_TARGET)",
    )
    p.add_argument("--timeout", type=_POSITIVE_SECONDS, default=10.0, help="seconds per call")
    from common.credentials import add_client_arguments

    add_client_arguments(p)


def _serve(args: argparse.Namespace) -> int:
    from common import extras, logs
    from service import settings
    from service.server import app as server

    try:
        resolved = settings.resolve(args, os.environ)
        if resolved.state:
            extras.require("postgres", "serve --state postgresql://...")
    except ConfigError as err:
        print(f"lattice-scheduler serve: {err}", file=sys.stderr)
        return 2
    logs.configure(resolved.log_format, resolved.log_level)
    try:
        if resolved.state:  # a replica; psycopg is imported only then
            from service.replicas import build as replica

            replica.serve(resolved)
        else:
            server.serve(resolved)
    except ConfigError as err:
        print(f"lattice-scheduler serve: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"lattice-scheduler serve: {err}", file=sys.stderr)
        return 1
    return 0


def _state_check(state_dir: str) -> int:
    from service.state.check import CannotCheck, check
    from service.state.integrity import StateDamaged

    try:
        report = check(state_dir)
    except CannotCheck as err:
        print(f"lattice-scheduler state check: {err}", file=sys.stderr)
        return 2
    except StateDamaged as err:
        print(f"lattice-scheduler state check: {err}", file=sys.stderr)
        return 1
    print(report.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
