"""The real `lattice-scheduler` process: flags, settings, signals, and the client commands.

Every process runs on loopback with free ports, and every wait is bounded.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.processes import LOOPBACK, Process, clean_env, scheduler_argv, spawn_scheduler
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from service.core import SchedulerConfig

from .wire import RPC_TIMEOUT_SECONDS

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_SECONDS = 20.0
EXIT_TIMEOUT_SECONDS = 20.0


def _cli() -> list[str]:
    """The installed console script, or the module when it is not installed."""
    script = Path(sys.executable).parent / "lattice-scheduler"
    return [str(script)] if script.exists() else [sys.executable, "-m", "service"]


@dataclass
class ServeProcess:
    """A `serve` process that printed its ports, with a channel to it."""

    process: Process
    channel: grpc.Channel

    @property
    def proc(self) -> subprocess.Popen:
        return self.process.popen

    @property
    def port(self) -> int:
        return self.process.ports[0]

    @property
    def metrics_port(self) -> int:
        return self.process.ports[1]

    @property
    def target(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    @property
    def stub(self) -> pb_grpc.SchedulerStub:
        return pb_grpc.SchedulerStub(self.channel)

    def stop(self) -> None:
        self.channel.close()
        self.process.kill()


def _spawn(log_dir: Path, *flags: str, env: dict[str, str] | None = None) -> ServeProcess:
    name = f"serve-{len(list(log_dir.glob('serve-*.log')))}"
    process = spawn_scheduler(
        name,
        log_dir,
        *flags,
        cwd=ROOT,
        env=env or clean_env(),
        timeout_seconds=START_TIMEOUT_SECONDS,
    )
    channel = grpc.insecure_channel(f"{LOOPBACK}:{process.ports[0]}")
    grpc.channel_ready_future(channel).result(timeout=RPC_TIMEOUT_SECONDS)
    return ServeProcess(process, channel)


@pytest.fixture
def spawn(tmp_path) -> Iterator:
    """Factory for `serve` processes; each is killed at teardown if still running."""
    started: list[ServeProcess] = []

    def factory(*flags: str, env: dict[str, str] | None = None) -> ServeProcess:
        started.append(_spawn(tmp_path, *flags, env=env))
        return started[-1]

    yield factory
    for p in started:
        p.stop()


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[ServeProcess]:
    """One `serve` process shared by the tests that only read from it or add to it."""
    p = _spawn(tmp_path_factory.mktemp("served"))
    yield p
    p.stop()


def _run(
    *args: str, env: dict[str, str] | None = None, timeout: float = 30.0
) -> subprocess.CompletedProcess:
    return subprocess.run(
        list(args),
        cwd=ROOT,
        env=env or clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _health(target: str, service: str = "") -> int:
    with grpc.insecure_channel(target) as channel:
        return (
            health_pb2_grpc.HealthStub(channel)
            .Check(health_pb2.HealthCheckRequest(service=service), timeout=RPC_TIMEOUT_SECONDS)
            .status
        )


# ===================================================================== serve


def test_serve_with_port_zero_prints_the_ports_and_serves_grpc_health_and_metrics(served):
    assert served.port > 0 and served.metrics_port > 0
    assert _health(served.target) == health_pb2.HealthCheckResponse.SERVING
    assert (
        _health(served.target, "lattice.scheduler.v1.Scheduler")
        == health_pb2.HealthCheckResponse.SERVING
    )
    url = f"http://{LOOPBACK}:{served.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=RPC_TIMEOUT_SECONDS) as resp:
        assert "lattice_scheduler_queue_depth" in resp.read().decode()


def test_serve_help_documents_every_setting_flag_and_its_env_var():
    result = _run(sys.executable, "-m", "service", "serve", "--help")
    assert result.returncode == 0, result.stderr
    for flag in (
        "--host",
        "--port",
        "--metrics-port",
        "--max-batch-size",
        "--chunk-size",
        "--prefill-reserve-pages",
        "--max-seq-len",
        "--max-queue",
        "--policy",
        "--lease-ttl-ms",
        "--config",
        "--grace-seconds",
        "--max-message-bytes",
    ):
        assert flag in result.stdout, f"{flag} is not documented in serve --help"
    assert "LATTICE_SCHEDULER_MAX_BATCH_SIZE" in result.stdout


@pytest.mark.parametrize(
    "flags, env, config_text, names",
    [
        (["--chunk-size", "0"], {}, None, ["chunk_size (--chunk-size)", "at least 1"]),
        (
            ["--chunk-size", "600", "--max-seq-len", "512"],
            {},
            None,
            ["chunk_size (600, --chunk-size)", "max_seq_len (512, --max-seq-len)"],
        ),
        (
            [],
            {"LATTICE_SCHEDULER_MAX_BATCH_SIZE": "abc"},
            None,
            ["max_batch_size (env LATTICE_SCHEDULER_MAX_BATCH_SIZE)"],
        ),
        ([], {}, "max_batch_size = [", ["--config", "TOML"]),
        ([], {}, "max_batch = 4\n", ["--config", "max_batch"]),
        (["--policy", "lifo"], {}, None, ["policy (--policy)", "lifo"]),
        (["--max-queue", "-1"], {}, None, ["max_queue (--max-queue)"]),
        (
            ["--max-message-bytes", "4"],
            {},
            None,
            ["max_message_bytes (--max-message-bytes)", "1024", "got 4"],
        ),
        (
            ["--max-num-batched-tokens", "16", "--max-batch-size", "32"],
            {},
            None,
            [
                "max_num_batched_tokens (16, --max-num-batched-tokens)",
                "max_batch_size (32, --max-batch-size)",
            ],
        ),
        (
            ["--min-prefill-chunk", "600"],
            {},
            None,
            ["min_prefill_chunk (600, --min-prefill-chunk)", "chunk_size (512, default)"],
        ),
        (["--aging-seconds", "0"], {}, None, ["aging_seconds (--aging-seconds)", "positive"]),
        (
            ["--tenant-weights", "/nonexistent/weights.toml"],
            {},
            None,
            ["tenant_weights (--tenant-weights)", "/nonexistent/weights.toml"],
        ),
        ([], {}, "tenant_weights = { gold = -2 }\n", ["tenant_weights", "'gold'", "positive"]),
    ],
    ids=[
        "flag-out-of-range",
        "chunk-above-max-seq-len",
        "env-not-an-integer",
        "config-not-toml",
        "config-unknown-key",
        "unknown-policy",
        "negative-max-queue",
        "tiny-max-message-bytes",
        "budget-below-batch",
        "first-chunk-above-chunk",
        "no-aging",
        "missing-tenant-weights",
        "negative-tenant-weight",
    ],
)
def test_serve_rejects_an_invalid_setting_naming_it_and_its_source(
    tmp_path, flags, env, config_text, names
):
    if config_text is not None:
        config = tmp_path / "scheduler.toml"
        config.write_text(config_text)
        flags = [*flags, "--config", str(config)]
    result = _run(*scheduler_argv(*flags), env=clean_env(**env), timeout=EXIT_TIMEOUT_SECONDS)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    for name in names:
        assert name in result.stderr, result.stderr


@pytest.mark.parametrize("which", ["port", "metrics-port"])
def test_serve_on_a_port_in_use_exits_2_with_one_line_naming_the_port(served, which):
    """Regression (outside probe): a taken gRPC port printed a gRPC core line plus ours and
    exited 1; a taken metrics port did not say which port."""
    taken = served.port if which == "port" else served.metrics_port
    ports = {"port": "0", "metrics-port": "0", which: str(taken)}
    result = _run(
        sys.executable,
        "-m",
        "service",
        "serve",
        "--host",
        LOOPBACK,
        "--port",
        ports["port"],
        "--metrics-port",
        ports["metrics-port"],
        timeout=EXIT_TIMEOUT_SECONDS,
    )
    assert result.returncode == 2
    what = "gRPC port" if which == "port" else "metrics port"
    assert result.stderr == (
        f"lattice-scheduler serve: {what} {taken} on {LOOPBACK} is already "
        f"in use (--{which}): stop what listens there, or choose another "
        f"port (0 picks a free one)\n"
    )
    # The first server is untouched and still the only one answering there.
    assert _health(served.target) == health_pb2.HealthCheckResponse.SERVING


def test_serve_on_a_zero_length_state_file_exits_2_with_one_line(spawn, tmp_path):
    """Regression (outside probe): a zero-length scheduler.db started empty, no warning."""
    state_dir = tmp_path / "state"
    first = spawn("--state-dir", str(state_dir))
    first.stub.Submit(
        pb.SubmitRequest(prompt_token_ids=[1], max_new_tokens=1), timeout=RPC_TIMEOUT_SECONDS
    )
    first.stop()
    for name in ("scheduler.db-wal", "scheduler.db-shm"):
        (state_dir / name).unlink(missing_ok=True)
    (state_dir / "scheduler.db").write_bytes(b"")
    result = _run(*scheduler_argv("--state-dir", str(state_dir)), timeout=EXIT_TIMEOUT_SECONDS)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(
        f"lattice-scheduler serve: {state_dir / 'scheduler.db'}: the file is empty (0 bytes)"
    )
    assert "restore the directory from a backup, or move it aside" in result.stderr


def test_settings_precedence_is_defaults_then_config_file_then_env_then_flags(spawn, tmp_path):
    config = tmp_path / "scheduler.toml"
    config.write_text(
        "max_batch_size = 3\nchunk-size = 7\nprefill_reserve_pages = 5\nlease_ttl_ms = 60000\n"
    )
    env = clean_env(LATTICE_SCHEDULER_CHUNK_SIZE="9", LATTICE_SCHEDULER_PREFILL_RESERVE_PAGES="6")
    p = spawn("--config", str(config), "--prefill-reserve-pages", "4", env=env)
    resp = p.stub.RegisterWorker(
        pb.RegisterWorkerRequest(worker_id="w", page_size=16), timeout=RPC_TIMEOUT_SECONDS
    )
    assert resp.max_batch_size == 3  # config file over the default 32
    assert resp.chunk_size == 9  # env over config file
    assert resp.prefill_reserve_pages == 4  # flag over env over config file
    assert resp.lease_ttl_ms == 60000  # config file, nothing above it


def test_sigterm_turns_health_not_serving_then_exits_zero_within_the_grace_period(spawn):
    grace_seconds = 1.0
    p = spawn("--grace-seconds", str(grace_seconds))
    # A Generate stream that never finishes keeps a call in flight through the grace period.
    generate = p.stub.Generate(pb.SubmitRequest(prompt_token_ids=[1], max_new_tokens=1), timeout=30)
    assert next(generate).seq_id > 0
    watch = health_pb2_grpc.HealthStub(p.channel).Watch(
        health_pb2.HealthCheckRequest(service="lattice.scheduler.v1.Scheduler"), timeout=30
    )
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING

    sent_at = time.monotonic()
    p.proc.send_signal(signal.SIGTERM)
    assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert p.proc.wait(timeout=grace_seconds + EXIT_TIMEOUT_SECONDS) == 0
    elapsed = time.monotonic() - sent_at
    # The in-flight call got its grace period, and not much more.
    assert grace_seconds * 0.8 <= elapsed <= grace_seconds + 5.0, elapsed
    with pytest.raises(grpc.RpcError):
        for _ in generate:
            pass


# ===================================================================== client commands


def test_client_commands_submit_status_and_cancel_against_a_real_server(served):
    target = ["--target", served.target, "--timeout", "10"]
    sub = _run(
        *_cli(), "submit", *target, "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--count", "2"
    )
    assert sub.returncode == 0, sub.stderr
    found = re.findall(r"seq_id=(\d+) queue_position=(\d+)", sub.stdout)
    assert len(found) == 2
    (first, first_pos), (second, second_pos) = found
    assert int(second_pos) == int(first_pos) + 1

    overview = _run(*_cli(), "status", *target)
    assert overview.returncode == 0, overview.stderr
    assert (
        f"policy={SchedulerConfig().policy}" in overview.stdout
        and "queue_depth=" in overview.stdout
    )

    one = _run(*_cli(), "status", *target, first)
    assert one.returncode == 0, one.stderr
    assert f"seq_id={first} state=SEQUENCE_STATE_QUEUED" in one.stdout
    assert "prompt_len=3" in one.stdout

    cancelled = _run(*_cli(), "cancel", *target, first)
    assert cancelled.returncode == 0, cancelled.stderr
    assert f"seq_id={first} cancelled=true" in cancelled.stdout
    after = _run(*_cli(), "status", *target, first)
    assert "state=SEQUENCE_STATE_FINISHED" in after.stdout
    assert "finish_reason=FINISH_REASON_CANCELLED" in after.stdout


def test_client_commands_report_rpc_errors_in_one_line_and_exit_non_zero(served):
    target = ["--target", served.target, "--timeout", "10"]
    missing = _run(*_cli(), "cancel", *target, "987654")
    assert missing.returncode != 0
    assert "NOT_FOUND" in missing.stderr and "987654" in missing.stderr
    assert "Traceback" not in missing.stderr
    # Within what the command checks itself, beyond the server's max_seq_len (4096).
    invalid = _run(*_cli(), "submit", *target, "--prompt-ids", "1", "--max-new-tokens", "5000")
    assert invalid.returncode == 1
    assert "INVALID_ARGUMENT" in invalid.stderr and "max_seq_len" in invalid.stderr


def test_drain_command_drains_and_resumes_a_worker_saying_what_is_still_on_it(served):
    target = ["--target", served.target, "--timeout", "10"]
    stub = served.stub
    stub.RegisterWorker(
        pb.RegisterWorkerRequest(
            worker_id="cli-drain", total_kv_pages=64, page_size=16, total_gdn_slots=8
        ),
        timeout=RPC_TIMEOUT_SECONDS,
    )
    stub.Submit(
        pb.SubmitRequest(prompt_token_ids=[1, 2], max_new_tokens=2), timeout=RPC_TIMEOUT_SECONDS
    )
    # Ours, or what other tests left queued ahead of it: at most two admissions.
    held = len(
        stub.SelectBatch(
            pb.SelectBatchRequest(worker_id="cli-drain", kv_free_pages=64, gdn_free_slots=2),
            timeout=RPC_TIMEOUT_SECONDS,
        ).prefill
    )
    assert held >= 1

    def draining() -> bool:
        workers = stub.GetStatus(pb.GetStatusRequest(), timeout=RPC_TIMEOUT_SECONDS).workers
        return next(w.draining for w in workers if w.worker_id == "cli-drain")

    drained = _run(*_cli(), "drain", *target, "cli-drain")
    assert drained.returncode == 0, drained.stderr
    assert drained.stdout.splitlines() == [
        f"worker=cli-drain drain requested (admits nothing new); sequences still on it: {held}"
    ]
    assert draining() is True
    resumed = _run(*_cli(), "drain", *target, "cli-drain", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.splitlines() == [
        f"worker=cli-drain drain lifted (admits again); sequences still on it: {held}"
    ]
    assert draining() is False

    unknown = _run(*_cli(), "drain", *target, "no-such-worker")
    assert unknown.returncode != 0 and "Traceback" not in unknown.stderr
    assert "FAILED_PRECONDITION" in unknown.stderr and "no-such-worker" in unknown.stderr


@pytest.mark.parametrize(
    "command",
    [["status"], ["submit"], ["generate"], ["cancel", "1"], ["load"]],
    ids=lambda command: command[0],
)
def test_client_command_without_a_server_fails_fast_saying_where_it_looked(command):
    with socket.socket() as s:  # a loopback port that nobody listens on
        s.bind((LOOPBACK, 0))
        free = s.getsockname()[1]
    started = time.monotonic()
    # A refused connection ends the command at once, not after --timeout.
    result = _run(
        *_cli(),
        command[0],
        "--target",
        f"{LOOPBACK}:{free}",
        "--timeout",
        "60",
        *command[1:],
        timeout=20,
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 1
    assert result.stderr == (
        f"lattice-scheduler {command[0]}: cannot reach the scheduler at "
        f"{LOOPBACK}:{free} (connection refused)\n"
    )
    assert elapsed < 5.0, elapsed  # the process's start-up, mostly
