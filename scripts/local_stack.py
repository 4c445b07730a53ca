#!/usr/bin/env python3
"""The local stack without Docker: a scheduler, CPU workers with the tiny model, a demo load.

Starts `lattice-scheduler serve` and N `lattice-worker` processes on loopback, waits until
every worker has registered, runs a short demo load (progress while it runs, throughput
and latency at the end), then keeps the stack up until Ctrl-C (or exits with --exit).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc

from service.loadgen import LoadSpec, run_load

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=50051, help="scheduler gRPC port")
    parser.add_argument("--metrics-port", type=int, default=9400)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--model", default="tiny", help="tiny, a checkpoint dir, or scripted")
    parser.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--requests", type=int, default=24, help="demo load: Generate streams")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--exit", action="store_true", help="stop the stack after the demo")
    parser.add_argument("--state-dir", type=Path, default=ROOT / ".artifacts" / "local-stack" / "state",
                        help="the scheduler's durable state (a restart on it carries on)")
    args = parser.parse_args()

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    logs = ROOT / ".artifacts" / "local-stack"
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    target = f"127.0.0.1:{args.port}"
    try:
        procs.append(_spawn([sys.executable, "-m", "service", "serve", "--port", str(args.port),
                             "--metrics-port", str(args.metrics_port),
                             "--state-dir", str(args.state_dir)],
                            logs / "scheduler.log", env))
        _wait_serving(target, procs[0])
        print(f"scheduler: {target}, metrics http://127.0.0.1:{args.metrics_port}/metrics "
              f"(log {logs / 'scheduler.log'}, state in {args.state_dir})", flush=True)
        # Each worker gets its share of the cores: oversubscribed torch threads crawl.
        threads = max(1, (os.cpu_count() or 1) // args.workers)
        for i in range(args.workers):
            worker_id = f"cpu-worker-{i + 1}"
            procs.append(_spawn([sys.executable, "-m", "worker_client", "--scheduler", target,
                                 "--worker-id", worker_id, "--model", args.model,
                                 "--device", args.device, "--threads", str(threads)],
                                logs / f"{worker_id}.log", env))
        _wait_workers(target, args.workers, procs)
        print(f"workers: {args.workers} registered (model {args.model}, device {args.device}; "
              f"logs in {logs})", flush=True)
        spec = LoadSpec(num_requests=args.requests, concurrency=args.concurrency,
                        max_new_tokens=args.max_new_tokens)
        print(f"demo load: {spec.num_requests} Generate streams, {spec.concurrency} at a time, "
              f"prompts {spec.min_prompt_len}-{spec.max_prompt_len} tokens, "
              f"{spec.max_new_tokens} new tokens each", flush=True)
        report = run_load(target, spec)
        for line in report.lines():
            print(line, flush=True)
        if len(report.ok) != len(report.results):
            return 1
        if args.exit:
            return 0
        print("the stack keeps running; try `lattice-scheduler status` or "
              "`lattice-scheduler generate`. Ctrl-C stops it.", flush=True)
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        print("a process of the stack exited; see its log", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except RuntimeError as err:
        print(f"local stack: {err}", file=sys.stderr)
        return 1
    finally:
        _stop(procs)


def _spawn(cmd: list[str], log_path: Path, env: dict) -> subprocess.Popen:
    log = open(log_path, "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                            start_new_session=True)


def _wait_serving(target: str, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    channel = grpc.insecure_channel(target)
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the scheduler exited with {proc.returncode}; "
                               "see .artifacts/local-stack/scheduler.log (port in use?)")
        try:
            if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                    health_pb2.HealthCheckResponse.SERVING:
                channel.close()
                return
        except grpc.RpcError:
            time.sleep(0.2)
    raise RuntimeError(f"the scheduler did not become healthy within {timeout:.0f} s")


def _wait_workers(target: str, count: int, procs, timeout: float = 180.0) -> None:
    stub = pb_grpc.SchedulerStub(grpc.insecure_channel(target))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{' '.join(p.args[2:5])} exited with {p.returncode}; "
                                   "see its log in .artifacts/local-stack/")
        if len(stub.GetStatus(pb.GetStatusRequest(), timeout=5).workers) >= count:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{count} workers did not register within {timeout:.0f} s")


def _stop(procs: list[subprocess.Popen]) -> None:
    # Workers first (they drain), then the scheduler.
    for p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    sys.exit(main())
