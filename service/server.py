"""The scheduler process: gRPC server, health, reflection, metrics and graceful shutdown."""
from __future__ import annotations

import ipaddress
import logging
import signal
import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from prometheus_client import CollectorRegistry

from service import auth, credentials, decode_errors, ports
from service.core import ConfigError, Scheduler
from service.core.store import StoreError
from service.metrics import SchedulerMetrics
from service.servicer import SchedulerServicer
from service.settings import ServeSettings
from service.state_sqlite import SqliteStateStore

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Scheduler"].full_name


@dataclass
class RunningServer:
    """A started scheduler: its ports, and how to stop it."""

    grpc_server: grpc.Server
    health: health.HealthServicer
    metrics_http: object
    port: int
    metrics_port: int
    _stop_sweeper: threading.Event
    store: SqliteStateStore | None = None
    servicer: SchedulerServicer | None = None

    def stop(self, grace_seconds: float) -> None:
        """NOT_SERVING first, so balancers drain us; then stop with a grace period."""
        self.health.enter_graceful_shutdown()
        self.servicer.stop_streams_without_cancelling()
        self._stop_sweeper.set()
        self.grpc_server.stop(grace_seconds).wait()
        self.metrics_http.shutdown()
        if self.store is not None:
            # Under the core's lock: the lease sweeper may be saving right now.
            self.servicer.call(self.store.close)

    def wait(self) -> None:
        self.grpc_server.wait_for_termination()


def start(settings: ServeSettings, registry: CollectorRegistry | None = None) -> RunningServer:
    """Start serving on settings.host: gRPC on settings.port, metrics on settings.metrics_port.

    Raises ConfigError, before listening, when a TLS or tokens file is unreadable or wrong.
    """
    tls = credentials.server_credentials(settings.tls_cert, settings.tls_key,
                                         settings.tls_client_ca)
    interceptors = [decode_errors.DecodeErrorInterceptor()]
    if settings.auth_tokens:
        interceptors.append(auth.AuthInterceptor(auth.load_tokens(settings.auth_tokens)))
    ports.check_free("port", settings.host, settings.port)  # before the state loads
    ports.check_free("metrics_port", settings.host, settings.metrics_port)
    _warn_if_exposed(settings)
    registry = registry if registry is not None else CollectorRegistry()
    metrics = SchedulerMetrics(registry, named_tenants=(
        tenant for tenant, _ in settings.scheduler.tenant_weights))
    store = (SqliteStateStore(settings.state_dir, settings.state_fsync)
             if settings.state_dir else None)
    try:
        return _start(settings, registry, metrics, store, tls, interceptors)
    except BaseException:
        if store is not None:
            store.close()  # and its lock: the caller may try again
        raise


def _start(settings: ServeSettings, registry: CollectorRegistry, metrics: SchedulerMetrics,
           store: SqliteStateStore | None, tls, interceptors) -> RunningServer:
    sweep_seconds = min(1.0, settings.scheduler.lease_ttl_ms / 4000.0)
    try:
        # The sweeper checks leases every sweep_seconds: a gap of three means we stood still.
        core = Scheduler(settings.scheduler, observer=metrics, store=store,
                         stall_seconds=max(3 * sweep_seconds, 0.5),
                         max_decision_bytes=settings.max_message_bytes)
    except StoreError as err:
        raise ConfigError(f"state_dir {settings.state_dir!r}: cannot load it: {err}") from None
    if store is not None:
        recovered = core.status()
        log.info("state loaded", extra={"state_dir": settings.state_dir,
                                        "queued": recovered.queue_depth,
                                        "assigned": recovered.num_assigned,
                                        "workers": len(recovered.workers)})
    servicer = SchedulerServicer(core, metrics)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=settings.max_threads,
                                                    thread_name_prefix="rpc"),
                         interceptors=interceptors,
                         # gRPC sets SO_REUSEPORT by default: a second scheduler on a port
                         # already in use would bind it too and silently take a share of
                         # the connections (two queues, one address). Fail instead.
                         options=[("grpc.so_reuseport", 0),
                                  ("grpc.max_receive_message_length",
                                   settings.max_message_bytes)])
    pb_grpc.add_SchedulerServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME),
        server,
    )
    address = f"{_bracket(settings.host)}:{settings.port}"
    try:
        # grpcio returns 0 on failure in old releases and raises RuntimeError in new ones.
        port = (server.add_secure_port(address, tls) if tls is not None
                else server.add_insecure_port(address))
    except RuntimeError:
        port = 0
    if port == 0:
        raise ConfigError(f"cannot listen on {address} (--host, --port): address in use or "
                          "not available")
    metrics_http = ports.start_metrics_http(settings.host, settings.metrics_port, registry)
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    stop_sweeper = threading.Event()
    threading.Thread(target=_sweep_leases, args=(servicer, stop_sweeper, sweep_seconds),
                     name="lease-sweeper", daemon=True).start()
    return RunningServer(server, health_servicer, metrics_http, port,
                         metrics_http.server_port, stop_sweeper, store, servicer)


def _sweep_leases(servicer: SchedulerServicer, stop: threading.Event, every_seconds: float):
    """Drop silent workers even when no other worker calls (their sequences must move on)."""
    while not stop.wait(every_seconds):
        try:
            servicer.expire_leases()
        except Exception:  # noqa: BLE001 - keep sweeping; the next call may succeed
            log.exception("lease sweep failed")


def serve(settings: ServeSettings) -> None:
    """Run until SIGTERM or SIGINT, then shut down gracefully."""
    running = start(settings)
    print(f"lattice-scheduler listening on {settings.host}:{running.port} "
          f"(metrics on http://{_bracket(settings.host)}:{running.metrics_port}/metrics, "
          f"policy {settings.scheduler.policy}, {_security_summary(settings)}, "
          f"{_state_summary(settings, running)})", flush=True)
    log.info("serving", extra={"port": running.port, "metrics_port": running.metrics_port})
    stopping = threading.Event()

    def on_signal(signum, _frame):
        if not stopping.is_set():
            stopping.set()
            log.info("shutting down", extra={"signal": signal.Signals(signum).name,
                                             "grace_seconds": settings.grace_seconds})
            threading.Thread(target=running.stop, args=(settings.grace_seconds,)).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    running.wait()
    log.info("stopped")


def _state_summary(settings: ServeSettings, running: RunningServer) -> str:
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
        log.warning("authentication is off and the scheduler listens beyond loopback: anyone "
                    "who reaches the port can submit, cancel or act as a worker; see "
                    "--auth-tokens in docs/security.md", extra={"host": settings.host})
    elif not settings.tls_cert:
        log.warning("tokens are required but TLS is off: tokens cross the network in clear "
                    "text; see --tls-cert in docs/security.md", extra={"host": settings.host})


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
