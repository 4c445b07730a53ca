"""`lattice-scheduler`: serve, client conveniences (submit, generate, cancel, status), drain,
simulate."""
from __future__ import annotations

import argparse
import os
import sys

from service.core import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lattice-scheduler",
        description="Iteration-level scheduler for hybrid GDN + attention LLM workers.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    from service import settings  # light: no grpc import
    serve = sub.add_parser("serve", help="run the scheduler service",
                           description=settings.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    settings.add_arguments(serve)

    for name, help_text in (("submit", "enqueue sequences and print their ids"),
                            ("generate", "submit one sequence and print its tokens as they come")):
        p = sub.add_parser(name, help=help_text)
        _add_target(p)
        p.add_argument("--prompt-ids", help="comma-separated prompt token ids")
        p.add_argument("--prompt-len", type=int, default=16,
                       help="random prompt of this many tokens when --prompt-ids is absent")
        p.add_argument("--max-new-tokens", type=int, default=16)
        p.add_argument("--request-id", default="", help="idempotency key")
        p.add_argument("--temperature", type=float, default=0.0)
        p.add_argument("--seed", type=int, default=0)
        if name == "submit":
            p.add_argument("--count", type=int, default=1, help="how many sequences")
        else:
            p.add_argument("--stream-timeout", type=float, default=600.0,
                           help="seconds the whole stream may take (the sequence is "
                                "cancelled when it runs out)")

    p = sub.add_parser("load", help="a bounded demo load of concurrent Generate streams; "
                                    "prints progress, then throughput and latency")
    _add_target(p)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--min-prompt-len", type=int, default=8)
    p.add_argument("--max-prompt-len", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)

    p = sub.add_parser("cancel", help="cancel sequences")
    _add_target(p)
    p.add_argument("seq_ids", type=int, nargs="+")

    p = sub.add_parser("status", help="the scheduler's queue and workers, or given sequences")
    _add_target(p)
    p.add_argument("seq_ids", type=int, nargs="*")

    from service.gateway import cli as gateway_cli  # light: no fastapi or grpc import
    p = sub.add_parser("gateway", help="an OpenAI-compatible HTTP server in front of the "
                                       "scheduler", description=gateway_cli.DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    gateway_cli.add_arguments(p)

    p = sub.add_parser("drain", help="admin: admit nothing new to a worker while what it "
                                     "runs finishes (needs an admin token under --auth-tokens)")
    _add_target(p)
    p.add_argument("worker_id")
    p.add_argument("--resume", action="store_true", help="lift an earlier drain instead")

    from service.sim import cli as sim_cli
    sim_cli.add_parser(sub)

    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "simulate":
        return sim_cli.run(args)
    if args.command == "gateway":
        return gateway_cli.main(args)
    from service import client_commands
    try:
        return client_commands.run(args.command, args)
    except client_commands.CommandError as err:
        print(f"lattice-scheduler {args.command}: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"lattice-scheduler {args.command}: interrupted", file=sys.stderr)
        return 130


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=os.environ.get("LATTICE_SCHEDULER_TARGET",
                                                      "127.0.0.1:50051"),
                   help="scheduler address HOST:PORT (env LATTICE_SCHEDULER_TARGET)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per call")
    from service.credentials import add_client_arguments
    add_client_arguments(p)


def _serve(args: argparse.Namespace) -> int:
    from service import logs, server, settings
    try:
        resolved = settings.resolve(args, os.environ)
    except ConfigError as err:
        print(f"lattice-scheduler serve: {err}", file=sys.stderr)
        return 2
    logs.configure(resolved.log_format, resolved.log_level)
    try:
        server.serve(resolved)
    except ConfigError as err:
        print(f"lattice-scheduler serve: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"lattice-scheduler serve: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
