"""`lattice-scheduler gateway`: its flags, and the process around `server.run`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

DESCRIPTION = """\
An OpenAI-compatible HTTP server (POST /v1/completions, /v1/chat/completions, streaming
or not; GET /v1/models, /health, /metrics) in front of the scheduler. It tokenizes with
the checkpoint's tokenizer.json and chat template, submits over gRPC like any client, and
streams the text back. An Idempotency-Key (or X-Request-Id) header makes retries attach
to the same sequence; a client that disconnects cancels its sequence.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        default=os.environ.get("LATTICE_SCHEDULER_TARGET", "127.0.0.1:50051"),
        help="scheduler address HOST:PORT, or replicas HOST:PORT,HOST:PORT or "
        "dns:///NAME:PORT (env LATTICE_SCHEDULER_TARGET)",
    )
    parser.add_argument(
        "--model",
        required=True,
        type=Path,
        metavar="DIR",
        help="the checkpoint directory the workers serve (tokenizer.json, "
        "tokenizer_config.json, config.json; weights are not read)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="HTTP address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (0: a free one, printed)")
    parser.add_argument(
        "--served-model-name",
        default="",
        help="the model name clients send (default: the directory's name)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        help="prompt + completion tokens at most; set it to the scheduler's "
        "--max-seq-len (default: min(max_position_embeddings, 4096))",
    )
    parser.add_argument(
        "--reattach-grace-seconds",
        type=float,
        default=30.0,
        help="how long a sequence with an Idempotency-Key runs on after its "
        "client left, for a retry to re-attach (0: cancel at once)",
    )
    parser.add_argument(
        "--reconnect-seconds",
        type=float,
        default=30.0,
        help="how long a stream with an Idempotency-Key waits for a scheduler "
        "that went away (a restart) to re-attach it (0: fail at once)",
    )
    parser.add_argument(
        "--grace-seconds",
        type=float,
        default=10.0,
        help="on SIGTERM, how long answers in flight may take to finish",
    )
    parser.add_argument(
        "--api-keys",
        type=Path,
        default=None,
        metavar="FILE",
        help="the gateway's own API keys (TOML, or JSON ending in .json; "
        "docs/security.md): /v1 requests then need "
        "'Authorization: Bearer <key>', and each key is a principal "
        "(default: no keys checked)",
    )
    parser.add_argument(
        "--metrics-path",
        default="/metrics",
        help="where GET serves Prometheus metrics; 'off' serves none (default /metrics)",
    )
    parser.add_argument(
        "--header-timeout-seconds",
        type=float,
        default=10.0,
        help="a request's headers must arrive within this long of the "
        "connection opening (or the previous answer), else it is closed",
    )
    parser.add_argument(
        "--body-timeout-seconds",
        type=float,
        default=30.0,
        help="a request's body must arrive within this long of its headers",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=8 * 1024 * 1024,
        help="a larger request body is refused with 413 before it is read (default 8 MiB)",
    )
    parser.add_argument(
        "--keep-alive-seconds",
        type=float,
        default=5.0,
        help="an idle connection between requests is closed after this long",
    )
    parser.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error")
    )
    parser.add_argument("--log-format", default="text", choices=("text", "json"))
    from common.credentials import add_client_arguments

    add_client_arguments(parser)


def main(args: argparse.Namespace) -> int:
    from common import extras, logs
    from common.errors import ConfigError

    try:
        extras.require("gateway", "lattice-scheduler gateway")
    except extras.MissingExtra as err:
        print(f"lattice-scheduler gateway: {err}", file=sys.stderr)
        return 2
    from common.credentials import client_args_credentials
    from service.gateway.server import GatewaySettings, run

    logs.configure(args.log_format, args.log_level)
    logging.getLogger().handlers[0].addFilter(_drop_uvicorn_colours)
    for flag, value in (
        ("--reattach-grace-seconds", args.reattach_grace_seconds),
        ("--reconnect-seconds", args.reconnect_seconds),
        ("--grace-seconds", args.grace_seconds),
    ):
        if value < 0:
            print(
                f"lattice-scheduler gateway: {flag} must not be negative (got {value:g})",
                file=sys.stderr,
            )
            return 2
    for flag, value in (
        ("--header-timeout-seconds", args.header_timeout_seconds),
        ("--body-timeout-seconds", args.body_timeout_seconds),
        ("--keep-alive-seconds", args.keep_alive_seconds),
    ):
        if not value > 0:
            print(
                f"lattice-scheduler gateway: {flag} must be positive (got {value:g})",
                file=sys.stderr,
            )
            return 2
    if args.max_body_bytes < 1:
        print(
            f"lattice-scheduler gateway: --max-body-bytes must be at least 1 "
            f"(got {args.max_body_bytes})",
            file=sys.stderr,
        )
        return 2
    metrics_path = None if args.metrics_path == "off" else args.metrics_path
    if metrics_path is not None and (
        not metrics_path.startswith("/") or metrics_path.startswith("/v1/")
    ):
        print(
            f"lattice-scheduler gateway: --metrics-path must be a path starting with / "
            f"outside /v1/, or off (got {args.metrics_path!r})",
            file=sys.stderr,
        )
        return 2
    if not 0 <= args.port <= 65535:
        print(
            f"lattice-scheduler gateway: --port must be 0-65535 (got {args.port})", file=sys.stderr
        )
        return 2
    try:
        settings = GatewaySettings(
            target=args.target,
            model_dir=args.model,
            host=args.host,
            port=args.port,
            served_model_name=args.served_model_name,
            max_model_len=args.max_model_len,
            reattach_grace_seconds=args.reattach_grace_seconds,
            reconnect_seconds=args.reconnect_seconds,
            grace_seconds=args.grace_seconds,
            credentials=client_args_credentials(args),
            token=args.token,
            api_keys_file=args.api_keys,
            metrics_path=metrics_path,
            header_timeout_seconds=args.header_timeout_seconds,
            body_timeout_seconds=args.body_timeout_seconds,
            keep_alive_seconds=args.keep_alive_seconds,
            max_body_bytes=args.max_body_bytes,
        )
        run(settings)
    except ConfigError as err:
        print(f"lattice-scheduler gateway: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"lattice-scheduler gateway: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


def _drop_uvicorn_colours(record: logging.LogRecord) -> bool:
    """uvicorn adds a terminal-coloured copy of some messages; the log has the plain one."""
    record.__dict__.pop("color_message", None)
    return True
