"""Secured schedulers on loopback: a throwaway PKI, a tokens file, and a server factory.

`secure_server(tls=..., mtls=..., auth=...)` starts one in-process scheduler on
127.0.0.1 (free ports, its own CollectorRegistry); every one is stopped at teardown.
"""

from __future__ import annotations

import secrets
import threading
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

from common.credentials import channel_credentials, open_channel
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from service.core import SchedulerConfig
from service.server.app import RunningServer, start
from service.settings import ServeSettings

from .pki import Pki, make_pki

LOOPBACK = "127.0.0.1"
RPC_TIMEOUT_SECONDS = 5.0


@dataclass(frozen=True)
class Tokens:
    """One token per role; worker tokens bound to w1 and w2. More client tokens, each its
    own principal: `client2` (named "mallory"), `unnamed1` and `unnamed2` (no name: the
    principal is the token's hash), `tenanted` (bound to tenant "acme")."""

    client: str
    admin: str
    w1: str
    w2: str
    client2: str
    unnamed1: str
    unnamed2: str
    tenanted: str
    file: Path

    def all(self) -> list[str]:
        return [
            self.client,
            self.admin,
            self.w1,
            self.w2,
            self.client2,
            self.unnamed1,
            self.unnamed2,
            self.tenanted,
        ]


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def tokens(tmp_path_factory) -> Tokens:
    values = {
        name: f"{name}-{secrets.token_urlsafe(24)}"
        for name in ("client", "admin", "w1", "w2", "client2", "unnamed1", "unnamed2", "tenanted")
    }
    path = tmp_path_factory.mktemp("auth") / "tokens.toml"
    path.write_text(
        f'[[tokens]]\ntoken = "{values["client"]}"\nrole = "client"\nname = "frontend"\n\n'
        f'[[tokens]]\ntoken = "{values["admin"]}"\nrole = "admin"\n\n'
        f'[[tokens]]\ntoken = "{values["w1"]}"\nrole = "worker"\nworker_id = "w1"\n\n'
        f'[[tokens]]\ntoken = "{values["w2"]}"\nrole = "worker"\nworker_id = "w2"\n\n'
        f'[[tokens]]\ntoken = "{values["client2"]}"\nrole = "client"\nname = "mallory"\n\n'
        f'[[tokens]]\ntoken = "{values["unnamed1"]}"\nrole = "client"\n\n'
        f'[[tokens]]\ntoken = "{values["unnamed2"]}"\nrole = "client"\n\n'
        f'[[tokens]]\ntoken = "{values["tenanted"]}"\nrole = "client"\n'
        f'name = "acme-frontend"\ntenant = "acme"\n'
    )
    return Tokens(**values, file=path)


@dataclass
class SecureServer:
    running: RunningServer
    registry: CollectorRegistry
    pki: Pki

    @property
    def target(self) -> str:
        return f"{LOOPBACK}:{self.running.port}"

    def channel(
        self, token: str | None = None, *, tls: bool = True, client_cert: bool = False
    ) -> grpc.Channel:
        """A channel as a client would open it: CA, optional client pair, optional token."""
        pair = self.pki.client if client_cert else None
        credentials = (
            channel_credentials(self.pki.ca.cert, pair and pair.cert, pair and pair.key)
            if tls
            else None
        )
        return open_channel(self.target, credentials, token)

    def stub(self, token: str | None = None, **channel_options) -> pb_grpc.SchedulerStub:
        return pb_grpc.SchedulerStub(self.channel(token, **channel_options))

    def scrape(self) -> str:
        url = f"http://{LOOPBACK}:{self.running.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=RPC_TIMEOUT_SECONDS) as resp:
            return resp.read().decode()


@pytest.fixture(scope="session")
def _stoppers() -> Iterator[list[threading.Thread]]:
    """Threads stopping servers; the session waits for all of them at its end.

    The metrics server's shutdown() waits out a 0.5 s poll, which would otherwise
    dominate every test's teardown.
    """
    threads: list[threading.Thread] = []
    yield threads
    for t in threads:
        t.join(timeout=10)


@pytest.fixture
def secure_server(pki, tokens, _stoppers) -> Iterator[Callable[..., SecureServer]]:
    """Factory: secure_server(tls=True, mtls=False, auth=True, **SchedulerConfig fields)."""
    servers: list[SecureServer] = []

    def factory(
        *, tls: bool = True, mtls: bool = False, auth: bool = True, **scheduler_config
    ) -> SecureServer:
        settings = ServeSettings(
            host=LOOPBACK,
            port=0,
            metrics_port=0,
            max_threads=16,
            tls_cert=str(pki.server.cert) if tls else "",
            tls_key=str(pki.server.key) if tls else "",
            tls_client_ca=str(pki.ca.cert) if mtls else "",
            auth_tokens=str(tokens.file) if auth else "",
            scheduler=SchedulerConfig(**scheduler_config),
        ).validate()
        registry = CollectorRegistry()
        servers.append(SecureServer(start(settings, registry), registry, pki))
        return servers[-1]

    yield factory
    for s in servers:
        stopper = threading.Thread(target=s.running.stop, args=(0.0,), name="stop-test-server")
        stopper.start()
        _stoppers.append(stopper)
