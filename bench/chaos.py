#!/usr/bin/env python3
"""Chaos run: the fault tests' stack (bench/harness/fault_stack.py) driven for longer.

A real scheduler process (--state-dir, fixed loopback port) and scripted worker
processes run while one client thread submits sequences with unique request_ids and
collectors stream every acknowledged one by re-attaching Generate. At seeded random
times within --seconds the scheduler is killed with SIGKILL and restarted at once on the
same port and state dir, and workers are killed with SIGKILL and restarted under the
same id after a random pause (0 to 1.5 leases: sometimes before their lease ends,
sometimes after). Afterwards every acknowledged sequence is checked: known, finished
once, with exactly the scripted model's reference tokens.

Prints progress while it runs and a markdown table at the end; exits 1 if anything
acknowledged was lost or came out wrong.

    python -m bench.chaos --seconds 60 --sequences 300 --scheduler-kills 5 \\
        --worker-kills 3 --seed 1
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.harness.fault_stack import Clients, Stack, check, make_jobs, report_run
from bench.harness.tables import markdown_table

PROGRESS_EVERY_SECONDS = 2.0


@dataclass(frozen=True)
class Fault:
    at_seconds: float
    kind: str  # "scheduler" | "worker"


def fault_schedule(args: argparse.Namespace, rng: random.Random) -> list[Fault]:
    """Kills at random times in the middle 80% of the window, in time order."""
    faults = [
        Fault(rng.uniform(0.1, 0.9) * args.seconds, "scheduler")
        for _ in range(args.scheduler_kills)
    ]
    faults += [
        Fault(rng.uniform(0.1, 0.9) * args.seconds, "worker") for _ in range(args.worker_kills)
    ]
    return sorted(faults, key=lambda f: f.at_seconds)


class Chaos:
    def __init__(self, args: argparse.Namespace, directory: Path) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        worker_flags = ("--max-batch-size", str(args.max_batch_size)) if args.max_batch_size else ()
        self.stack = Stack(
            directory,
            num_workers=args.workers,
            lease_ttl_ms=args.lease_ttl_ms,
            step_ms=args.step_ms,
            worker_flags=worker_flags,
        )
        self.jobs = make_jobs(
            args.sequences,
            seed=args.seed,
            prefix="chaos",
            max_new_tokens_range=(8, args.max_new_tokens),
        )
        # Acknowledged sequences not finished yet, at each scheduler kill.
        self.unfinished_at_kills: list[int] = []
        self.clients: Clients | None = None
        self.started_at = time.monotonic()
        self._next_progress = 0.0
        # worker_id -> when to start it again
        self._pending_restarts: dict[str, float] = {}

    def run(self) -> None:
        args, stack = self.args, self.stack
        stack.start()
        self.started_at = time.monotonic()
        self.say(f"stack up: scheduler on {stack.target}, workers {', '.join(stack.worker_ids)}")
        self.clients = Clients(
            stack.target,
            self.jobs,
            submit_interval_seconds=0.8 * args.seconds / args.sequences,
            num_collectors=args.collectors,
            deadline_seconds=args.seconds + args.drain_seconds,
        ).start()
        for fault in fault_schedule(args, self.rng):
            self.run_until(fault.at_seconds)
            if fault.kind == "scheduler":
                self.unfinished_at_kills.append(self.unfinished())
                self.say(
                    f"kill -9 scheduler ({self.unfinished_at_kills[-1]} acknowledged "
                    f"sequences unfinished)"
                )
                stack.restart_scheduler()
                restart = stack.restarts[-1]
                self.say(
                    f"scheduler restarted (listening after "
                    f"{restart.listening_at - restart.started_at:.2f} s)"
                )
            else:
                self.kill_a_worker()
        self.run_until(args.seconds)
        self.start_pending_workers(force=True)
        self.say("fault window over; waiting for every sequence to finish")
        while self.clients.running():
            self.progress()
            time.sleep(0.2)

    def kill_a_worker(self) -> None:
        """Kill a random worker, but never the last one running: if only one runs, wait
        (at most two leases) for a killed one to come back first."""
        give_up_at = time.monotonic() + 2 * self.args.lease_ttl_ms / 1000
        while len(alive := self.alive_workers()) < 2:
            if time.monotonic() > give_up_at or not self._pending_restarts:
                self.say("worker kill skipped: it would leave no worker running")
                return
            self.start_pending_workers()
            time.sleep(0.05)
        victim = self.rng.choice(alive)
        pause = self.rng.uniform(0.0, 1.5) * self.args.lease_ttl_ms / 1000
        self.say(f"kill -9 worker {victim}; restarting it in {pause:.2f} s")
        self.stack.kill_worker(victim)
        self._pending_restarts[victim] = time.monotonic() + pause

    def alive_workers(self) -> list[str]:
        return [
            w
            for w, p in self.stack.workers.items()
            if p.alive() and w not in self._pending_restarts
        ]

    def start_pending_workers(self, force: bool = False) -> None:
        for worker_id, at in list(self._pending_restarts.items()):
            if force or time.monotonic() >= at:
                del self._pending_restarts[worker_id]
                self.stack.start_worker(worker_id)
                self.say(f"worker {worker_id} started again under the same id")

    def run_until(self, at_seconds: float) -> None:
        """Restart pending workers and print progress until `at_seconds` into the run."""
        while (left := self.started_at + at_seconds - time.monotonic()) > 0:
            self.start_pending_workers()
            self.progress()
            time.sleep(min(0.05, left))

    def unfinished(self) -> int:
        return sum(j.seq_id is not None and j.finish_reason is None for j in self.jobs)

    def progress(self) -> None:
        now = time.monotonic() - self.started_at
        if now < self._next_progress:
            return
        self._next_progress = now + PROGRESS_EVERY_SECONDS
        finished = sum(j.finish_reason is not None for j in self.jobs)
        self.say(
            f"acknowledged {self.clients.num_acknowledged}/{len(self.jobs)}, "
            f"finished {finished}, in flight {self.unfinished()}, "
            f"scheduler kills {self.stack.scheduler_kills}, "
            f"worker kills {self.stack.worker_kills}"
        )

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started_at:6.1f} s] {message}", flush=True)


def table(args: argparse.Namespace, chaos: Chaos, outcome, wall_seconds: float) -> str:
    stack = chaos.stack
    recovery = [
        r.first_finish_at - r.started_at
        for r in stack.restarts[1:]
        if r.first_finish_at is not None
    ]
    no_finish = len(stack.restarts) - 1 - len(recovery)
    if recovery:
        recovery_text = f"{statistics.median(recovery):.2f} s / {max(recovery):.2f} s"
        if no_finish:
            recovery_text += (
                f" ({no_finish} restart{'s' if no_finish > 1 else ''} killed before finishing any)"
            )
    else:
        recovery_text = "n/a"
    batch = f", batch {args.max_batch_size}" if args.max_batch_size else ""
    scenario = (
        f"{args.workers} workers{batch}, step {args.step_ms:g} ms, 8-"
        f"{args.max_new_tokens} new tokens, lease {args.lease_ttl_ms / 1000:g} s, "
        f"{args.seconds:g} s window, seed {args.seed}"
    )
    header = [
        "scenario",
        "sequences submitted",
        "acknowledged",
        "scheduler kills",
        "worker kills",
        "restarts (scheduler + worker)",
        "lost",
        "duplicated tokens",
        "wrong outputs",
        "wall time",
        "restart to first finished sequence (median / max)",
    ]
    row = [
        scenario,
        str(outcome.submitted),
        str(outcome.acknowledged),
        str(stack.scheduler_kills),
        str(stack.worker_kills),
        f"{len(stack.restarts) - 1 + stack.worker_restarts} "
        f"({len(stack.restarts) - 1} + {stack.worker_restarts})",
        str(outcome.lost),
        str(outcome.duplicated_tokens),
        str(outcome.wrong_outputs),
        f"{wall_seconds:.1f} s",
        recovery_text,
    ]
    return markdown_table(header, [row])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.chaos", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=60.0,
        help="fault window: submissions and kills happen within it",
    )
    parser.add_argument("--sequences", type=int, default=300)
    parser.add_argument("--scheduler-kills", type=int, default=5)
    parser.add_argument("--worker-kills", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--step-ms", type=float, default=10.0, help="simulated step time of the scripted workers"
    )
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=0,
        help="most sequences per worker (0: the scheduler's default)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=40,
        help="each sequence asks for 8 to this many tokens",
    )
    parser.add_argument("--lease-ttl-ms", type=int, default=2000)
    parser.add_argument(
        "--collectors",
        type=int,
        default=16,
        help="concurrent Generate streams re-attaching to sequences",
    )
    parser.add_argument(
        "--drain-seconds",
        type=float,
        default=120.0,
        help="after the window, how long the sequences get to finish",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the state dir and process logs (kept anyway on failure)",
    )
    args = parser.parse_args(argv)
    if args.sequences < 1 or args.seconds <= 0 or args.workers < 1:
        parser.error("--sequences and --workers must be at least 1, --seconds above 0")
    if args.max_new_tokens < 8:
        parser.error("--max-new-tokens must be at least 8")

    directory = Path(tempfile.mkdtemp(prefix="lattice-chaos-"))
    chaos = Chaos(args, directory)
    started = time.monotonic()
    try:
        chaos.run()
        outcome = check(chaos.stack.stub, chaos.jobs)
    finally:
        if chaos.clients is not None:
            chaos.clients.close()
        chaos.stack.close()
    wall_seconds = time.monotonic() - started
    clients = chaos.clients
    print(
        f"\nSubmit retries {clients.num_submit_retries}, stream re-attachments "
        f"{clients.num_reattachments}, missing tokens {outcome.missing_tokens}, "
        f"acknowledged sequences unfinished at each scheduler kill "
        f"{chaos.unfinished_at_kills}"
    )
    return report_run(
        outcome,
        table(args, chaos, outcome, wall_seconds),
        directory,
        keep=args.keep,
        kept="state dir and process logs",
    )


if __name__ == "__main__":
    sys.exit(main())
