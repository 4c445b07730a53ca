#!/usr/bin/env python3
"""The scheduler under a fleet's traffic: each subcommand prints its comparison side by side.

Every scheduler here is a real `lattice-scheduler serve` process on loopback (its RSS and
CPU time read from /proc); clients and fake workers run in this process on one asyncio
loop (grpc.aio), scripted workers are `lattice-worker --model scripted` processes.
`--before DIR` adds rows from the scheduler of another checkout (e.g. a worktree of the
commit before this change), started with this interpreter from DIR.

    .venv/bin/python -m bench.traffic streams     # 10,000 idle Generate streams, 16 workers
    .venv/bin/python -m bench.traffic honest      # 2,000 streams read to the end, 4 workers
    .venv/bin/python -m bench.traffic watch       # 1,000 unauthenticated Health.Watch, tokens on
    .venv/bin/python -m bench.traffic decisions   # decisions/s, 64 workers: echo, unary, session
    .venv/bin/python -m bench.traffic overlap     # 8 scripted workers, --step-ms 10
    .venv/bin/python -m bench.traffic idle        # 16 idle workers: CPU, Submit to a worker
    .venv/bin/python -m bench.traffic submits     # acknowledged Submits/s, 16 submitters
    .venv/bin/python -m bench.traffic report-cost # CPU per report, 256 decoding
    .venv/bin/python -m bench.traffic report-cost --floor  # and what no scheduling costs

The machine these ran on has 2 cores shared with other work: read ratios within one run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from bench.traffic.decisions import cmd_decisions
from bench.traffic.echo import cmd_echo_server
from bench.traffic.idle import cmd_idle
from bench.traffic.overlap import cmd_overlap
from bench.traffic.report_cost import cmd_report_cost
from bench.traffic.streams import cmd_honest, cmd_streams, cmd_watch
from bench.traffic.submits import cmd_submits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.traffic",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, fn: Callable, help_text: str, **defaults) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(fn=fn)
        for key, value in defaults.items():
            p.add_argument("--" + key.replace("_", "-"), type=type(value), default=value)
        p.add_argument(
            "--before",
            metavar="DIR",
            help="also run the scheduler of another checkout (rows 'before')",
        )
        return p

    add(
        "streams",
        cmd_streams,
        "idle Generate streams next to iterating workers",
        streams=10_000,
        workers=16,
        batch=32,
        seconds=10.0,
        step_ms=0.0,
    )
    add(
        "honest",
        cmd_honest,
        "streams read to the end with scripted workers",
        streams=2000,
        workers=4,
        batch=256,
        max_new_tokens=32,
        timeout=120.0,
    )
    add(
        "watch",
        cmd_watch,
        "unauthenticated Health.Watch streams, tokens on",
        watchers=1000,
        workers=4,
        batch=32,
        seconds=10.0,
    )
    add(
        "decisions",
        cmd_decisions,
        "decisions/s: echo floor, unary, session",
        workers=64,
        batch=4,
        seconds=5.0,
        rounds=3,
    )
    add(
        "overlap",
        cmd_overlap,
        "scripted workers with step time: overlap on and off",
        workers=8,
        batch=16,
        step_ms=10.0,
        max_new_tokens=300,
    )
    add(
        "idle",
        cmd_idle,
        "idle workers: scheduler CPU, Submit to a parked worker",
        workers=16,
        seconds=20.0,
        submits=200,
    )
    cost = add(
        "report-cost",
        cmd_report_cost,
        "scheduler CPU per report, 1 scripted worker decoding --batch on a session",
        batch=256,
        step_ms=10.0,
        seconds=10.0,
        idle_seconds=5.0,
        max_new_tokens=3000,
    )
    cost.add_argument(
        "--nano-vllm",
        metavar="DIR",
        help="a nano-vllm checkout: its CPU per decision in the same run",
    )
    cost.add_argument(
        "--floor",
        action="store_true",
        help="also an in-process worker against bare echo servicers (with "
        "and without the interceptors) and this scheduler",
    )
    add(
        "submits",
        cmd_submits,
        "acknowledged Submits/s with concurrent submitters",
        submitters=16,
        seconds=10.0,
        tmp_dir=".artifacts",
    )
    echo = sub.add_parser("echo-server", help="(internal) the bare echo servicer")
    echo.add_argument("--port", type=int, default=0)
    echo.add_argument(
        "--new-form", action="store_true", help="take packed tokens and unchanged running lists"
    )
    echo.add_argument("--interceptors", choices=("none", "default", "auth"), default="none")
    echo.add_argument("--tokens", help="the tokens file, for --interceptors auth")
    echo.set_defaults(fn=cmd_echo_server)
    args = parser.parse_args(argv)
    args.fn(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
