"""The gateway process: settings, the scheduler link, uvicorn on one socket, shutdown.

SIGTERM/SIGINT (uvicorn's handlers): stop accepting, let answers in flight finish for up
to `grace_seconds`, then cancel the rest (their sequences are cancelled with them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from prometheus_client import CollectorRegistry

from common.errors import ConfigError
from service.gateway.generations import Generations
from service.gateway.metrics import GatewayMetrics
from service.gateway.model_files import DEFAULT_MAX_MODEL_LEN, ModelFiles
from service.gateway.scheduler_link import SchedulerLink

if TYPE_CHECKING:
    from service.gateway.app import Gateway

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewaySettings:
    target: str  # the scheduler, HOST:PORT
    model_dir: Path
    host: str = "127.0.0.1"
    port: int = 8000  # 0 picks a free port (printed)
    served_model_name: str = ""  # "" = the model directory's name
    max_model_len: int = 0  # 0 = min(config.json max_position_embeddings, 4096)
    reattach_grace_seconds: float = 30.0
    reconnect_seconds: float = 30.0  # keyed streams re-attach after a scheduler restart
    grace_seconds: float = 10.0
    credentials: grpc.ChannelCredentials | None = None
    token: str | None = None
    api_keys_file: Path | None = None  # None: no keys checked (one anonymous principal)
    metrics_path: str | None = "/metrics"  # None: no metrics route
    # Connection deadlines (service/gateway/timeouts.py; keep-alive: uvicorn's own).
    header_timeout_seconds: float = 10.0
    body_timeout_seconds: float = 30.0
    keep_alive_seconds: float = 5.0
    max_body_bytes: int = 8 * 1024 * 1024  # larger bodies: 413 before they are read

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_dir.resolve().name


def resolve_max_model_len(settings: GatewaySettings, files: ModelFiles) -> int:
    if settings.max_model_len < 0:
        raise ConfigError(f"--max-model-len must be at least 1 (got {settings.max_model_len})")
    if settings.max_model_len:
        return settings.max_model_len
    return min(files.max_position_embeddings or DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_MODEL_LEN)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (bound and listening before uvicorn starts, so that port 0 can
    be printed, and a client that read the banner is queued, not refused, while uvicorn's
    startup runs)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {err.strerror}") from None
    sock.listen(2048)  # uvicorn's default backlog; it listens again on this socket
    return sock


def build_gateway(settings: GatewaySettings, files: ModelFiles, link) -> Gateway:
    """Everything the routes use, over `link` (a SchedulerLink, or a test's fake)."""
    from service.gateway.api_keys import load_api_keys
    from service.gateway.app import Gateway

    registry = CollectorRegistry()
    return Gateway(
        files=files,
        served_model_name=settings.model_name,
        max_model_len=resolve_max_model_len(settings, files),
        link=link,
        generations=Generations(link, settings.reattach_grace_seconds, settings.reconnect_seconds),
        metrics=GatewayMetrics(registry),
        registry=registry,
        started_at=int(time.time()),
        api_keys=(
            load_api_keys(settings.api_keys_file) if settings.api_keys_file is not None else None
        ),
        metrics_path=settings.metrics_path,
        max_body_bytes=settings.max_body_bytes,
    )


def uvicorn_config(app, settings: GatewaySettings):
    """uvicorn's settings for the gateway: no access log, graceful stop, deadlines."""
    import uvicorn

    from service.gateway.timeouts import guarded_h11

    return uvicorn.Config(
        app,
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=settings.grace_seconds,
        timeout_keep_alive=settings.keep_alive_seconds,
        http=guarded_h11(settings.header_timeout_seconds, settings.body_timeout_seconds),
    )


async def serve(
    settings: GatewaySettings, files: ModelFiles, on_listening: Callable[[str], None] = print
) -> None:
    """Run until SIGTERM/SIGINT. `files` is read before, so a bad model dir fails fast."""
    import uvicorn

    from service.gateway.app import create_app

    link = SchedulerLink(settings.target, settings.credentials, settings.token)
    try:
        gateway = build_gateway(settings, files, link)
    except BaseException:
        await link.close()
        raise
    sock = bind(settings.host, settings.port)
    app = create_app(gateway)
    port = sock.getsockname()[1]

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        keys = (
            f"{len(gateway.api_keys)} API keys" if gateway.api_keys is not None else "no API keys"
        )
        on_listening(
            f"lattice-scheduler gateway listening on http://{settings.host}:{port} "
            f"(model {gateway.served_model_name!r}, scheduler {settings.target}, "
            f"{keys})"
        )
        problem = await link.check_health()
        if problem is not None:
            log.warning(
                "the scheduler is not serving yet; requests get 503 until it is: %s", problem
            )
        yield

    app.router.lifespan_context = lifespan
    try:
        await uvicorn.Server(uvicorn_config(app, settings)).serve(sockets=[sock])
    finally:
        await link.close()
        sock.close()


def run(settings: GatewaySettings) -> None:
    files = ModelFiles(settings.model_dir)
    # uvicorn handles SIGTERM while it serves (graceful shutdown), then raises the signal
    # again once it has stopped; absorbing that second one lets the process exit 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    asyncio.run(serve(settings, files, on_listening=lambda line: print(line, flush=True)))
