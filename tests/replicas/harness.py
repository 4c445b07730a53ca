"""Replica processes on one PostgreSQL database, for kill -9 and outage tests.

`ReplicaStack` runs N `lattice-scheduler serve --state URL` processes and scripted
worker processes (each worker lists its own replica first, then the others, so it
moves on when its replica goes away). `ReplicaClients` are the fault stack's Clients over
one round_robin channel to every replica. Every process is killed at close.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import grpc

from bench.harness.fault_stack import (
    CHANNEL_OPTIONS,
    START_TIMEOUT_SECONDS,
    Clients,
    Proc,
    kill_all,
)
from common.processes import LOOPBACK, SCHEDULER_LISTENING, free_port, scheduler_argv
from common.targets import ROUND_ROBIN
from common.waiting import wait_until
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc


class ReplicaStack:
    """Scheduler replicas and their workers; see the module docstring."""

    def __init__(
        self,
        directory: Path,
        database_url: str,
        *,
        num_replicas: int = 2,
        workers_per_replica: int = 2,
        step_ms: float = 10.0,
        lease_ttl_ms: int = 3000,
        replica_lease_ms: int = 1500,
        replica_args: tuple[str, ...] = (),
    ) -> None:
        self.directory = Path(directory)
        self.database_url = database_url
        self.ports = [free_port() for _ in range(num_replicas)]
        self.targets = [f"{LOOPBACK}:{port}" for port in self.ports]
        self.step_ms = step_ms
        self.lease_ttl_ms = lease_ttl_ms
        self.replica_lease_ms = replica_lease_ms
        self.replica_args = replica_args  # more `serve` flags for every replica
        self.metrics_ports: list[int | None] = [None] * num_replicas
        self.replicas: list[Proc | None] = [None] * num_replicas
        self.workers: dict[str, Proc] = {}
        self.all_procs: list[Proc] = []
        self.worker_home = {
            f"w{r}{i}": r for r in range(num_replicas) for i in range(workers_per_replica)
        }
        self.channel = grpc.insecure_channel(
            "ipv4:" + ",".join(self.targets), options=[*CHANNEL_OPTIONS, ROUND_ROBIN]
        )
        self.stub = pb_grpc.SchedulerStub(self.channel)

    def start(self) -> ReplicaStack:
        for index in range(len(self.ports)):
            self.start_replica(index)
        for worker_id in self.worker_home:
            self.start_worker(worker_id)
        wait_until(
            lambda: self.num_workers() == len(self.worker_home),
            "every worker registered",
            START_TIMEOUT_SECONDS,
            retry_on=(grpc.RpcError,),
        )
        return self

    def close(self) -> None:
        kill_all(self.all_procs)
        self.channel.close()

    def start_replica(self, index: int) -> None:
        proc = Proc(
            f"replica{index}",
            scheduler_argv(
                "--state",
                self.database_url,
                "--lease-ttl-ms",
                str(self.lease_ttl_ms),
                "--replica-lease-ms",
                str(self.replica_lease_ms),
                *self.replica_args,
                port=self.ports[index],
            ),
            self.directory / f"replica{index}.{len(self.all_procs)}.log",
        )
        self.all_procs.append(proc)
        self.replicas[index] = proc
        banner = proc.wait_for_line(SCHEDULER_LISTENING, START_TIMEOUT_SECONDS)
        if banner is None:
            raise AssertionError(f"replica {index} did not start:\n{proc.log_text()}")
        self.metrics_ports[index] = int(banner.groups()[-1])

    def kill_replica(self, index: int) -> None:
        proc = self.replicas[index]
        assert proc is not None and proc.alive(), f"replica {index} is not up"
        proc.kill()

    def start_worker(self, worker_id: str) -> None:
        home = self.worker_home[worker_id]
        order = self.targets[home:] + self.targets[:home]
        proc = Proc(
            worker_id,
            [
                sys.executable,
                "-m",
                "worker_client",
                "--scheduler",
                ",".join(order),
                "--worker-id",
                worker_id,
                "--model",
                "scripted",
                "--step-ms",
                str(self.step_ms),
            ],
            self.directory / f"{worker_id}.log",
        )
        self.all_procs.append(proc)
        self.workers[worker_id] = proc

    def num_workers(self) -> int:
        """Workers registered on the replicas that answer."""
        count = 0
        for target in self.targets:
            with grpc.insecure_channel(target) as channel:
                try:
                    status = pb_grpc.SchedulerStub(channel).GetStatus(
                        pb.GetStatusRequest(), timeout=2.0
                    )
                except grpc.RpcError:
                    continue
                count += len(status.workers)
        return count

    def log_tails(self, max_lines: int = 60) -> str:
        parts = []
        for proc in self.all_procs:
            lines = proc.log_text().splitlines()[-max_lines:]
            parts.append(f"===== {proc.name} =====\n" + "\n".join(lines))
        return "\n".join(parts)


class ReplicaClients(Clients):
    """tests/faults' Clients over one round_robin channel to every replica."""

    def __init__(self, targets: list[str], jobs, **kwargs) -> None:
        super().__init__(targets[0], jobs, **kwargs)
        self._channel.close()
        self._channel = grpc.insecure_channel(
            "ipv4:" + ",".join(targets), options=[*CHANNEL_OPTIONS, ROUND_ROBIN]
        )
        self._stub = pb_grpc.SchedulerStub(self._channel)


def wait_all_done(clients: list[ReplicaClients], timeout: float) -> None:
    end = time.monotonic() + timeout
    for c in clients:
        c.wait_done(max(1.0, end - time.monotonic()))
