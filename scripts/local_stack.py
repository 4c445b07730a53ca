#!/usr/bin/env python3
"""The local stack without Docker: a scheduler, CPU workers, the OpenAI gateway, a demo load.

Starts `lattice-scheduler serve`, N `lattice-worker` processes and `lattice-scheduler
gateway` on loopback, waits until every worker has registered, runs a short demo load of
streamed chat completions through the gateway with the `openai` client (progress while it
runs, throughput and latency at the end), then keeps the stack up until Ctrl-C, SIGTERM or
SIGHUP (or exits with --exit), and stops every process it started. The default model is
a demo checkpoint (the tiny model with a small BPE tokenizer and a chat template), built on
the first run under .artifacts/demo-model.

`--replicas N` runs N scheduler replicas on ports PORT, PORT+1, ... sharing a private
PostgreSQL cluster (initdb and pg_ctl under .artifacts/local-stack/postgres, or a
temporary directory where the postgres user cannot reach .artifacts, on a free port);
workers are spread over them, each listing its own replica first; the gateway lists all.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.processes import gateway_argv, worker_argv
from common.waiting import WaitFailed, wait_until
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from service.gateway.demo_load import HttpLoadSpec, run_http_load

ROOT = Path(__file__).resolve().parent.parent
DEMO_MODEL = ROOT / ".artifacts" / "demo-model"
# --engine vllm: the demo model with heads wide enough for vLLM's CPU kernels.
DEMO_MODEL_WIDE = ROOT / ".artifacts" / "demo-model-wide"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=50051, help="scheduler gRPC port")
    parser.add_argument("--metrics-port", type=int, default=9400)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--gateway-port", type=int, default=8000, help="the OpenAI-compatible gateway's HTTP port"
    )
    parser.add_argument(
        "--model",
        default=str(DEMO_MODEL),
        help="a checkpoint dir with its tokenizer (default: the demo checkpoint, "
        "built on the first run), or tiny / scripted (the gateway then "
        "uses the demo checkpoint's tokenizer)",
    )
    parser.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"))
    parser.add_argument(
        "--engine",
        default="reference",
        choices=("reference", "vllm"),
        help="the workers' engine; vllm: workers run from .venv-vllm "
        "(scripts/run_local.sh --engine vllm sets it up) on a checkpoint directory "
        "(default: the demo checkpoint with wider heads)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=24,
        help="demo load: streamed chat completions through the gateway",
    )
    parser.add_argument(
        "--turns",
        type=int,
        default=4,
        help="demo load: requests per conversation (each turn sends the "
        "conversation so far, so it can resume from a worker's prefix "
        "cache; 1: independent requests)",
    )
    parser.add_argument(
        "--concurrency", type=int, default=8, help="demo load: conversations at a time"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="demo load: new tokens per request (default 32; 64 with --engine vllm, whose "
        "cache blocks are 256 tokens on a hybrid model: a conversation's prompts must span "
        "a block before a later turn can resume from it)",
    )
    parser.add_argument("--exit", action="store_true", help="stop the stack after the demo")
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=ROOT / ".artifacts" / "local-stack" / "state",
        help="the scheduler's durable state (a restart on it carries on)",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="N scheduler replicas on a private PostgreSQL cluster instead of "
        "one scheduler on --state-dir (docs/replicas.md)",
    )
    args = parser.parse_args()
    if args.replicas < 0:
        parser.error(f"--replicas must not be negative, got {args.replicas}")
    if args.turns < 1:
        parser.error(f"--turns must be at least 1, got {args.turns}")
    if args.engine == "vllm" and args.model == str(DEMO_MODEL):
        args.model = str(DEMO_MODEL_WIDE)
    if args.max_new_tokens is None:
        args.max_new_tokens = 64 if args.engine == "vllm" else 32
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.engine == "vllm" and args.model in ("tiny", "scripted"):
        parser.error(f"--engine vllm runs a checkpoint directory, not --model {args.model}")
    _stop_on_signals()

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    logs = ROOT / ".artifacts" / "local-stack"
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    cluster = None
    num_schedulers = max(1, args.replicas)
    targets = [f"127.0.0.1:{args.port + i}" for i in range(num_schedulers)]
    target = ",".join(targets)
    try:
        gateway_model = _model_dirs(args.model)
        if args.replicas:
            cluster = _start_cluster(logs)
            state = ["--state", cluster.url]
        else:
            state = ["--state-dir", str(args.state_dir)]
        for i in range(num_schedulers):
            name = "scheduler" if num_schedulers == 1 else f"scheduler-{i + 1}"
            procs.append(
                _spawn(
                    [
                        sys.executable,
                        "-m",
                        "service",
                        "serve",
                        "--port",
                        str(args.port + i),
                        "--metrics-port",
                        str(args.metrics_port + i),
                        *state,
                    ],
                    logs / f"{name}.log",
                    env,
                )
            )
            _wait_serving(targets[i], procs[-1])
            print(
                f"{name}: {targets[i]}, metrics http://127.0.0.1:{args.metrics_port + i}"
                f"/metrics (log {logs / (name + '.log')}, state in "
                f"{cluster.url if cluster else args.state_dir})",
                flush=True,
            )
        # Each worker gets its share of the cores: oversubscribed torch threads crawl.
        threads = max(1, (os.cpu_count() or 1) // args.workers)
        for i in range(args.workers):
            worker_id = f"cpu-worker-{i + 1}"
            home = i % num_schedulers  # its own replica first, then the others
            order = ",".join(targets[home:] + targets[:home])
            worker_env = env
            if args.engine == "vllm":
                # vLLM binds its CPU threads itself: give each worker its own cores.
                first = i * threads % (os.cpu_count() or 1)
                worker_env = dict(env, VLLM_CPU_OMP_THREADS_BIND=f"{first}-{first + threads - 1}")
                argv = worker_argv(
                    order, worker_id, args.model, "--engine", "vllm", "--kv-cache-gib", "1",
                    python=VLLM_PYTHON,
                )  # fmt: skip
            else:
                argv = worker_argv(
                    order, worker_id, args.model, "--device", args.device, "--threads", str(threads)
                )
            procs.append(_spawn(argv, logs / f"{worker_id}.log", worker_env))
        model_name = gateway_model.name
        base_url = f"http://127.0.0.1:{args.gateway_port}"
        procs.append(
            _spawn(
                gateway_argv(target, gateway_model, port=args.gateway_port),
                logs / "gateway.log",
                env,
            )
        )
        _wait_http(f"{base_url}/health", procs[-1])
        print(
            f"gateway: {base_url}/v1 (OpenAI API, model {model_name!r}; "
            f"metrics {base_url}/metrics; log {logs / 'gateway.log'})",
            flush=True,
        )
        _wait_workers(targets, args.workers, procs)
        print(
            f"workers: {args.workers} registered (model {args.model}, device {args.device}; "
            f"logs in {logs})",
            flush=True,
        )
        spec = HttpLoadSpec(
            num_requests=args.requests,
            concurrency=args.concurrency,
            max_new_tokens=args.max_new_tokens,
            turns=args.turns,
        )
        print(
            f"demo load: {spec.num_requests} streamed chat completions through the gateway "
            f"({spec.num_conversations} conversations of up to {spec.turns} turns, "
            f"{spec.concurrency} at a time), up to {spec.max_new_tokens} new tokens each",
            flush=True,
        )
        metrics_urls = [
            f"http://127.0.0.1:{args.metrics_port + i}/metrics" for i in range(num_schedulers)
        ]
        before = _prefill_tokens(metrics_urls)
        report, results = run_http_load(base_url, model_name, spec)
        for line in report.lines():
            print(line, flush=True)
        print(_hit_rate_line(before, _prefill_tokens(metrics_urls)), flush=True)
        sample = next((r for r in results if not r.error), None)
        if sample is not None:
            print(
                f"a sample answer (random weights: noise, decoded by the checkpoint's "
                f"tokenizer): {sample.text[:80]!r}",
                flush=True,
            )
        if len(report.ok) != len(report.results):
            return 1
        if args.exit:
            return 0
        print(
            f"the stack keeps running; try\n"
            f"  curl {base_url}/v1/chat/completions -H 'content-type: application/json' "
            f'-d \'{{"model": "{model_name}", "messages": [{{"role": "user", '
            f'"content": "Hello"}}], "max_tokens": 16}}\'\n'
            f"or `lattice-scheduler status`. Ctrl-C stops it.",
            flush=True,
        )
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        print("a process of the stack exited; see its log", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, WaitFailed) as err:
        print(f"local stack: {err}", file=sys.stderr)
        return 1
    finally:
        _stop(procs)
        if cluster is not None:
            cluster.stop()
            print(f"PostgreSQL stopped (its data stays in {cluster.directory})", flush=True)


def _prefill_tokens(metrics_urls: list[str]) -> dict[str, float]:
    """The schedulers' prefill tokens so far, by source (computed, cached), summed."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    totals = {"computed": 0.0, "cached": 0.0}
    for url in metrics_urls:
        with urlopen(url, timeout=10) as answer:
            text = answer.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "lattice_scheduler_prefill_tokens_total":
                    totals[sample.labels["source"]] += sample.value
    return totals


def _hit_rate_line(before: dict[str, float], after: dict[str, float]) -> str:
    """The demo's prefix hit rate: prompt tokens taken from a worker's cache over all
    prompt tokens the workers were handed (the schedulers' counters over the demo)."""
    cached = after["cached"] - before["cached"]
    total = cached + after["computed"] - before["computed"]
    rate = cached / total if total else 0.0
    return (
        f"prefix cache: {cached:.0f} of {total:.0f} prompt tokens resumed from a "
        f"worker's cache (hit rate {rate:.2f})"
    )


def _start_cluster(logs: Path):
    """A private PostgreSQL cluster for the replicas: under .artifacts when the postgres
    user can reach it, else in a temporary directory (as root, PostgreSQL runs as postgres)."""
    import tempfile

    from service.state.pg_cluster import ClusterError, PrivateCluster

    try:
        cluster = PrivateCluster(logs / "postgres")
        cluster.start()
    except ClusterError as err:
        if "cannot reach it" not in str(err):
            raise RuntimeError(str(err)) from None
        cluster = PrivateCluster(Path(tempfile.mkdtemp(prefix="lattice-local-pg-")))
        cluster.start()
    print(
        f"postgres: {cluster.url} (data in {cluster.directory}, log {cluster.log_path})", flush=True
    )
    return cluster


def _model_dirs(model: str) -> Path:
    """The directory the gateway reads (the demo checkpoint's for tiny / scripted); builds
    the demo checkpoint on the first run."""
    if model not in ("tiny", "scripted") and Path(model) not in (DEMO_MODEL, DEMO_MODEL_WIDE):
        if not (Path(model) / "tokenizer.json").is_file():
            raise RuntimeError(
                f"--model {model}: no tokenizer.json there; the gateway needs "
                f"the checkpoint's tokenizer"
            )
        return Path(model)
    path = DEMO_MODEL_WIDE if Path(model) == DEMO_MODEL_WIDE else DEMO_MODEL
    if not (path / "config.json").is_file():
        print(
            f"demo model: building the tiny model (seed 0) with a BPE tokenizer and a chat "
            f"template in {path} (first run only)",
            flush=True,
        )
        from worker_client.demo_model import write_demo_checkpoint

        write_demo_checkpoint(path, seed=0, wide=path == DEMO_MODEL_WIDE)
    return path


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    def answers() -> bool:
        with urllib.request.urlopen(url, timeout=2):
            return True

    wait_until(
        answers,
        f"the gateway to answer {url}",
        timeout,
        every_seconds=0.2,
        retry_on=(urllib.error.URLError, OSError),
        gone=_exited(proc, "the gateway", "see .artifacts/local-stack/gateway.log (port in use?)"),
    )


def _spawn(cmd: list[str], log_path: Path, env: dict) -> subprocess.Popen:
    log = open(log_path, "w")
    return subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
    )


def _wait_serving(target: str, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        wait_until(
            lambda: (
                stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                == health_pb2.HealthCheckResponse.SERVING
            ),
            "the scheduler to be healthy",
            timeout,
            every_seconds=0.2,
            retry_on=(grpc.RpcError,),
            gone=_exited(
                proc, "the scheduler", "see .artifacts/local-stack/scheduler.log (port in use?)"
            ),
        )


def _wait_workers(targets: list[str], count: int, procs, timeout: float = 180.0) -> None:
    """Until `count` workers are registered, over every replica."""
    stubs = [pb_grpc.SchedulerStub(grpc.insecure_channel(t)) for t in targets]

    def any_exited() -> str | None:
        return next(
            (
                f"{' '.join(p.args[2:5])} exited with {p.returncode}; see its log in "
                ".artifacts/local-stack/"
                for p in procs
                if p.poll() is not None
            ),
            None,
        )

    wait_until(
        lambda: (
            sum(len(stub.GetStatus(pb.GetStatusRequest(), timeout=5).workers) for stub in stubs)
            >= count
        ),
        f"{count} workers to register",
        timeout,
        every_seconds=0.5,
        gone=any_exited,
    )


def _exited(proc: subprocess.Popen, what: str, hint: str):
    """For wait_until's `gone`: why waiting is over once `proc` has exited."""
    return lambda: None if proc.poll() is None else f"{what} exited with {proc.returncode}; {hint}"


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_hurry = []  # a signal came while stopping: kill what is left instead of waiting


def _stop_on_signals() -> None:
    """SIGINT, SIGTERM and SIGHUP stop the stack (the `finally` of main). Set explicitly:
    a shell starts a background job with SIGINT ignored, and Python keeps it so."""

    def on_signal(signum, _frame):
        for other in _STOP_SIGNALS:
            signal.signal(other, lambda *_: _hurry.append(True))
        print(f"local stack: {signal.Signals(signum).name}, stopping", file=sys.stderr, flush=True)
        raise KeyboardInterrupt

    for signum in _STOP_SIGNALS:
        signal.signal(signum, on_signal)


def _stop(procs: list[subprocess.Popen]) -> None:
    # Gateway and workers first (they drain), then the scheduler.
    for p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 20
            while p.poll() is None and time.monotonic() < deadline and not _hurry:
                time.sleep(0.1)
            if p.poll() is None:
                p.kill()
                p.wait()


if __name__ == "__main__":
    sys.exit(main())
