"""The scheduler process: a grpc.aio server on one event loop, with health, reflection,
metrics and graceful shutdown.

Concurrency model: one asyncio event loop (on its own thread, "scheduler-loop") runs
every RPC handler, the lease sweeper and the loop-lag clock; the core is called only from
that loop, so its calls never overlap. Nothing holds a thread per call or per stream.
Threads besides the loop: the metrics HTTP server, and the state store's fsync
(service/state/group_commit.py). `start` returns a handle usable from any thread.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from common import credentials
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from service.core import ConfigError, ReplicaScheduler, Scheduler
from service.core.persist.store import StateStore, StoreError
from service.server import health_reflection, ports
from service.server.interceptors import auth, decode_errors, limits
from service.server.loop_lag import LoopLag
from service.server.metrics import SchedulerMetrics
from service.server.observers import FanOut
from service.server.servicer import SchedulerServicer
from service.server.step_prior import load_step_prior
from service.server.wakeups import Wakeups
from service.settings import ServeSettings
from service.state.group_commit import GroupCommit
from service.state.sqlite import SqliteStateStore

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Scheduler"].full_name
HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# How often the loop-lag clock ticks (service/server/loop_lag.py).
LOOP_LAG_TICK_SECONDS = 0.025
# How long start() waits for the loop to come up and listen.
START_TIMEOUT_SECONDS = 60.0


@dataclass(frozen=True)
class Shared:
    """How a replica on a shared database differs from a lone scheduler: its store and its
    servicer. service/replicas/build.py makes one; that package imports this one, never the
    reverse (tests/test_imports.py)."""

    # (settings, registry) -> the store the core saves through; it counts into registry.
    open_store: Callable[[ServeSettings, CollectorRegistry], Any]
    # (core, wakeups, store, metrics, lag, settings, callers) -> the servicer; it also offers
    # background_tasks(port) (started with the server, given the port it listens on) and leave() (awaited at shutdown).
    make_servicer: Callable[..., SchedulerServicer]


@dataclass
class _Serving:
    """What runs on the loop: the servers, their servicers and the background tasks."""

    servers: list[grpc.aio.Server]
    health: health_reflection.HealthServicer
    servicer: SchedulerServicer
    port: int
    worker_port: int | None
    group_commit: GroupCommit | None = None
    tasks: list[asyncio.Task] = field(default_factory=list)

    async def stop(self, grace_seconds: float, store: StateStore | None) -> None:
        """NOT_SERVING first, so balancers drain us; then stop with a grace period."""
        await self.health.enter_graceful_shutdown()
        self.servicer.stop_streams_without_cancelling()
        await asyncio.gather(*(server.stop(grace_seconds) for server in self.servers))
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.group_commit is not None:
            await self.group_commit.close()
        if hasattr(self.servicer, "leave"):  # a replica: hand back its claims
            await self.servicer.leave()
        if store is not None:
            store.close()  # on the loop: nothing else calls the core any more


class _LoopThread:
    """An asyncio event loop running on its own thread until close()."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="scheduler-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        finally:
            self.loop.close()

    def run(self, coroutine, timeout: float | None = None):
        """Run `coroutine` on the loop from another thread; its result or its exception."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()

    def join(self) -> None:
        self._thread.join()


@dataclass
class RunningServer:
    """A started scheduler: its ports, and how to stop it (from any thread)."""

    port: int
    metrics_port: int
    worker_port: int | None
    metrics_http: object
    store: StateStore | None  # SqliteStateStore, or PostgresState for a replica
    _loop: _LoopThread
    _serving: _Serving
    _stop_lock: threading.Lock = field(default_factory=threading.Lock)
    _stopped: bool = False

    def stop(self, grace_seconds: float) -> None:
        """NOT_SERVING, then every RPC gets `grace_seconds` to finish; idempotent."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        try:
            self._loop.run(self._serving.stop(grace_seconds, self.store))
        finally:
            self._loop.close()
            self.metrics_http.shutdown()
            self.metrics_http.server_close()

    def wait(self) -> None:
        """Until the server has stopped."""
        self._loop.join()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop every handler runs on (call into it with call_soon_threadsafe)."""
        return self._loop.loop


def start(
    settings: ServeSettings, registry: CollectorRegistry | None = None, shared: Shared | None = None
) -> RunningServer:
    """Start serving on settings.host: gRPC on settings.port (and settings.worker_port),
    metrics on settings.metrics_port. A replica (settings.state set) needs `shared`:
    service.replicas.build.start passes it.

    Raises ConfigError, before listening, when a TLS or tokens file is unreadable or wrong.
    """
    if settings.state and shared is None:
        raise ConfigError(
            "state: a shared database is served by a replica; start it with "
            "service.replicas.build.start (lattice-scheduler serve --state does)"
        )
    tls = credentials.server_credentials(
        settings.tls_cert, settings.tls_key, settings.tls_client_ca
    )
    tokens = auth.load_tokens(settings.auth_tokens) if settings.auth_tokens else None
    ports.check_free("port", settings.host, settings.port)  # before the state loads
    ports.check_free("metrics_port", settings.host, settings.metrics_port)
    _warn_if_exposed(settings)
    registry = registry if registry is not None else CollectorRegistry()
    metrics = SchedulerMetrics(
        registry,
        named_tenants=(tenant for tenant, _ in settings.scheduler.tenant_weights),
        ttft_target_seconds=settings.scheduler.ttft_target_ms / 1000.0,
    )
    if shared is not None:
        store = shared.open_store(settings, registry)
    else:
        store = (
            SqliteStateStore(settings.state_dir, settings.state_fsync, defer_fsync=True)
            if settings.state_dir
            else None
        )
    loop = _LoopThread()
    try:
        serving = loop.run(
            _serve(settings, metrics, store, tls, tokens, shared), timeout=START_TIMEOUT_SECONDS
        )
    except BaseException:
        loop.close()
        if store is not None:
            store.close()  # and its lock: the caller may try again
        raise
    try:
        metrics_http = ports.start_metrics_http(settings.host, settings.metrics_port, registry)
    except BaseException:
        try:
            loop.run(serving.stop(0, store))
        finally:
            loop.close()
        raise
    return RunningServer(
        serving.port,
        metrics_http.server_port,
        serving.worker_port,
        metrics_http,
        store,
        loop,
        serving,
    )


async def _serve(
    settings: ServeSettings,
    metrics: SchedulerMetrics,
    store: StateStore | None,
    tls,
    tokens,
    shared: Shared | None,
) -> _Serving:
    """On the loop: the core, the servicer, the listening servers and the tasks."""
    sweep_seconds = min(1.0, settings.scheduler.lease_ttl_ms / 4000.0)
    wakeups = Wakeups()
    try:
        # The sweeper checks leases every sweep_seconds: a gap of three means we stood still.
        # A replica's core also takes and gives up sequences of the shared store.
        core_class = ReplicaScheduler if shared is not None else Scheduler
        core = core_class(
            settings.scheduler,
            observer=FanOut(metrics, wakeups),
            store=store,
            stall_seconds=max(3 * sweep_seconds, 0.5),
            max_decision_bytes=settings.max_message_bytes,
            step_prior=(load_step_prior(settings.step_table) if settings.step_table else None),
        )
    except StoreError as err:
        where = f"state_dir {settings.state_dir!r}" if settings.state_dir else "state"
        raise ConfigError(f"{where}: cannot load it: {err}") from None
    if store is not None:
        recovered = core.status()
        log.info(
            "state loaded",
            extra={
                "state_dir": settings.state_dir,
                "queued": recovered.queue_depth,
                "assigned": recovered.num_assigned,
                "workers": len(recovered.workers),
            },
        )
    lag = LoopLag(LOOP_LAG_TICK_SECONDS, observe=metrics.event_loop_lag.observe)
    if shared is not None:  # a replica: PostgreSQL commits in each save, no group commit
        group_commit = None
        servicer = shared.make_servicer(
            core, wakeups, store, metrics, lag, settings, auth.Callers(tokens)
        )
    else:
        group_commit = GroupCommit(store, metrics.on_fsync) if store is not None else None
        servicer = SchedulerServicer(
            core,
            wakeups,
            metrics=metrics,
            lag=lag,
            durable=group_commit.durable if group_commit is not None else None,
            durable_worker_progress=settings.state_fsync == "always",
            callers=auth.Callers(tokens),
        )
    health_servicer = health_reflection.HealthServicer()
    options = [
        # gRPC sets SO_REUSEPORT by default: a second scheduler on a port already in use
        # would bind it too and silently take a share of the connections (two queues, one
        # address). Fail instead.
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        # Calls that arrived but wait for the loop to take them: past the soft limit gRPC
        # cancels new ones at random (its default, 1000, cancelled streams of a burst of a few
        # thousand clients re-attaching at once). Room for every stream --max-streams allows.
        ("grpc.server.max_pending_requests", max(1000, settings.max_streams)),
        ("grpc.server.max_pending_requests_hard_limit", 3 * max(1000, settings.max_streams)),
    ]
    first = [decode_errors.DecodeErrorInterceptor()]
    if tokens is not None:
        first.append(auth.AuthInterceptor(tokens))
    stream_limits = limits.StreamLimitInterceptor(
        max_streams=settings.max_streams,
        max_open_streams=settings.max_open_streams,
        on_change=metrics.on_streams,
    )
    main = grpc.aio.server(interceptors=[*first, stream_limits], options=options)
    pb_grpc.add_SchedulerServicer_to_server(servicer, main)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, main)
    health_reflection.enable_reflection((SERVICE_NAME, HEALTH_SERVICE_NAME), main)
    servers = [main]
    port = _listen(main, settings.host, settings.port, tls)
    worker_port = None
    if settings.worker_port:
        workers_only = grpc.aio.server(
            interceptors=[*first, limits.WorkerPortInterceptor(settings.worker_port)],
            options=options,
        )
        pb_grpc.add_SchedulerServicer_to_server(servicer, workers_only)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, workers_only)
        worker_port = _listen(
            workers_only, settings.host, settings.worker_port, tls, server_role="workers"
        )
        servers.append(workers_only)
    for server in servers:
        await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    tasks = [
        asyncio.create_task(_sweep_leases(servicer, sweep_seconds), name="lease-sweeper"),
        asyncio.create_task(lag.run(), name="loop-lag"),
    ]
    if group_commit is not None:
        tasks.append(asyncio.create_task(group_commit.run_checkpoints(), name="checkpoints"))
    if shared is not None:
        tasks.extend(servicer.background_tasks(port))
    return _Serving(servers, health_servicer, servicer, port, worker_port, group_commit, tasks)


def _listen(server: grpc.aio.Server, host: str, port: int, tls, server_role: str = "main") -> int:
    address = f"{_bracket(host)}:{port}"
    try:
        # grpcio returns 0 on failure in old releases and raises RuntimeError in new ones.
        bound = (
            server.add_secure_port(address, tls)
            if tls is not None
            else server.add_insecure_port(address)
        )
    except RuntimeError:
        bound = 0
    if bound == 0:
        flag = "--port" if server_role == "main" else "--worker-port"
        raise ConfigError(
            f"cannot listen on {address} (--host, {flag}): address in use or not available"
        )
    return bound


async def _sweep_leases(servicer: SchedulerServicer, every_seconds: float) -> None:
    """Drop silent workers even when no other worker calls (their sequences must move on)."""
    while True:
        await asyncio.sleep(every_seconds)
        try:
            servicer.expire_leases()
        except Exception:  # keep sweeping; the next call may succeed
            log.exception("lease sweep failed")


def serve(settings: ServeSettings, shared: Shared | None = None) -> None:
    """Run until SIGTERM or SIGINT, then shut down gracefully (`shared`: as for start)."""
    running = start(settings, shared=shared)
    stopping = threading.Event()

    def on_signal(signum, _frame):
        if not stopping.is_set():
            stopping.set()
            log.info(
                "shutting down",
                extra={
                    "signal": signal.Signals(signum).name,
                    "grace_seconds": settings.grace_seconds,
                },
            )
            threading.Thread(target=running.stop, args=(settings.grace_seconds,)).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # Only now: whoever reads this line may signal at once, and the shutdown is graceful.
    print(
        f"lattice-scheduler listening on {settings.host}:{running.port} "
        f"(metrics on http://{_bracket(settings.host)}:{running.metrics_port}/metrics, "
        f"policy {settings.scheduler.policy}, {_security_summary(settings)}, "
        f"{_state_summary(settings, running)}{_worker_port_summary(running)})",
        flush=True,
    )
    log.info("serving", extra={"port": running.port, "metrics_port": running.metrics_port})
    running.wait()
    log.info("stopped")


def _worker_port_summary(running: RunningServer) -> str:
    return "" if running.worker_port is None else f", worker port {running.worker_port}"


def _state_summary(settings: ServeSettings, running: RunningServer) -> str:
    if settings.state:
        return (
            f"replica {running.store.replica_id} of the state in {running.store.path}, "
            f"fsync {settings.state_fsync}"
        )
    if running.store is None:
        return "state in memory only (--state-dir keeps it across restarts)"
    return f"state in {running.store.path}, fsync {settings.state_fsync}"


def _security_summary(settings: ServeSettings) -> str:
    transport = ("mTLS" if settings.tls_client_ca else "TLS") if settings.tls_cert else "plaintext"
    return f"{transport}, {'tokens required' if settings.auth_tokens else 'no authentication'}"


def _warn_if_exposed(settings: ServeSettings) -> None:
    """Plaintext or unauthenticated is fine on loopback; elsewhere, say so (but serve)."""
    if _is_loopback(settings.host):
        return
    if not settings.auth_tokens:
        log.warning(
            "authentication is off and the scheduler listens beyond loopback: anyone "
            "who reaches the port can submit, cancel or act as a worker; see "
            "--auth-tokens in docs/security.md",
            extra={"host": settings.host},
        )
    elif not settings.tls_cert:
        log.warning(
            "tokens are required but TLS is off: tokens cross the network in clear "
            "text; see --tls-cert in docs/security.md",
            extra={"host": settings.host},
        )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
