#!/usr/bin/env python3
"""kill -9 of a handoff's sender or receiver, cycle after cycle (issue 31's target: 20
cycles, 0 acknowledged lost, 0 tokens twice).

The stack of tests/faults/test_handoff_kills.py (bench/harness/handoff_stack.py): a real
scheduler process and `lattice-worker` processes on the tiny Qwen3.5 model, one
`--role prefill` (the sender) and `--decoders` `--role decode` (the receivers). A client
submits a steady stream of 1,030-1,100-token prompts, long enough that each is prefilled
on the prefill worker and handed off. Each cycle waits until a handoff is in flight
(lattice_scheduler_handoffs_started_total above the sum of
lattice_scheduler_handoffs_total{end}), kills -9 the sender (even cycles) or a receiver
(odd cycles, the decode workers in turn) and starts it again under the same id at once.
After the last cycle submissions stop and every acknowledged sequence is checked:
finished once, with the reference engine's greedy tokens (fault_stack.check).

Prints one line per cycle and a summary table; exits 1 if anything acknowledged was
lost, duplicated or wrong (the stack's directory, with every process's log, is kept).

    python -m bench.handoff_kills --cycles 20
    python -m bench.handoff_kills --quick
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench.harness.fault_stack import Clients, Stack, check, report_run
from bench.harness.handoff_stack import (
    handoff_counts,
    handoff_prompts,
    handoffs_in_flight,
    set_expected,
    start_role_worker,
)
from bench.harness.tables import markdown_table

SENDER = "prefill-0"
REGISTERED = re.compile(r"registered worker_id=")
POLL_SECONDS = 0.01


class Cycles:
    def __init__(self, args: argparse.Namespace, directory: Path) -> None:
        self.args = args
        self.roles = {SENDER: "prefill"}
        self.roles.update({f"decode-{i}": "decode" for i in range(args.decoders)})
        self.stack = Stack(directory, num_workers=0, lease_ttl_ms=args.lease_ttl_ms)
        # A stream longer than the run needs; only the jobs submitted get their expected
        # tokens from the reference engine, after the run.
        self.jobs = handoff_prompts(args.sequences, seed=args.seed, prefix=f"kills-{args.seed}")
        self.clients: Clients | None = None
        self.kills = {"sender": 0, "receiver": 0}
        self.kills_mid_handoff = 0
        self.started_at_last_kill = 0.0
        self.last_counts: dict[str, float] = {}
        self.started_at = time.monotonic()

    def run(self) -> None:
        args, stack = self.args, self.stack
        stack.start()
        for worker_id, role in self.roles.items():
            start_role_worker(stack, worker_id, role)
        stack.wait_workers(len(self.roles), timeout=120)
        self.started_at = time.monotonic()
        self.clients = Clients(
            stack.target,
            self.jobs,
            submit_interval_seconds=args.submit_interval_seconds,
            deadline_seconds=args.deadline_seconds,
        ).start()
        for cycle in range(1, args.cycles + 1):
            self.cycle(cycle)
        self.clients.stop_submitting()
        self.say("cycles over; no more submissions; waiting for every sequence to finish")
        while self.clients.running():
            time.sleep(0.2)

    def cycle(self, cycle: int) -> None:
        """Kill -9 one end with a handoff in flight, start it again, wait until it is
        registered again. Cycles 1, 5, 9, ...: the sender, when the scheduler's books
        hold a handoff; 3, 7, 11, ...: the sender, its receivers paused from before the
        handoff begins until after the kill (the kill lands before their fetch); even
        cycles: a receiver, the decode workers in turn."""
        started_at = time.monotonic()
        receivers = [w for w, role in self.roles.items() if role == "decode"]
        if cycle % 2 == 0:
            end, victim, how = "receiver", receivers[(cycle // 2 - 1) % len(receivers)], ""
            in_flight = self.wait_for_a_handoff_in_flight(self.args.cycle_timeout_seconds)
            self.kill_and_restart(victim)
        elif cycle % 4 == 1:
            end, victim, how = "sender", SENDER, ""
            in_flight = self.wait_for_a_handoff_in_flight(self.args.cycle_timeout_seconds)
            self.kill_and_restart(victim)
        else:
            end, victim, how = "sender", SENDER, ", receivers paused"
            paused = [self.stack.workers[w] for w in receivers]
            for proc in paused:
                proc.popen.send_signal(signal.SIGSTOP)
            # Only a handoff begun from here on is one no receiver can have fetched.
            self.started_at_last_kill = handoff_counts(self.stack)["started"]
            try:
                # Well inside the receivers' lease: they must not lose it while paused.
                pause_seconds = 0.5 * self.args.lease_ttl_ms / 1000
                in_flight = self.wait_for_a_handoff_in_flight(pause_seconds)
                self.kill_and_restart(victim)
            finally:
                for proc in paused:
                    proc.popen.send_signal(signal.SIGCONT)
        self.kills[end] += 1
        self.kills_mid_handoff += in_flight > 0
        # The next kill waits for the new process to be registered.
        if (
            self.stack.workers[victim].wait_for_line(REGISTERED, self.args.cycle_timeout_seconds)
            is None
        ):
            raise AssertionError(f"{victim} did not register again after its kill")
        counts = handoff_counts(self.stack)
        failed = sum(v for k, v in counts.items() if k not in ("started", "done"))
        new_failures = ", ".join(
            f"{k} +{v - self.last_counts.get(k, 0.0):g}"
            for k, v in counts.items()
            if k not in ("started", "done") and v > self.last_counts.get(k, 0.0)
        )
        self.last_counts = counts
        self.say(
            f"cycle {cycle:2d}: kill -9 {end} {victim}{how}, {in_flight:g} handoff(s) in "
            f"flight, back in {time.monotonic() - started_at:.1f} s; handoffs done "
            f"{counts['done']:g}, failed {failed:g} ({new_failures or 'none new'})"
        )

    def kill_and_restart(self, worker_id: str) -> None:
        self.stack.kill_worker(worker_id)
        start_role_worker(self.stack, worker_id, self.roles[worker_id])

    def wait_for_a_handoff_in_flight(self, timeout_seconds: float) -> float:
        """Handoffs in flight once one begun since the last kill is (one begun before may
        be the killed worker's, not ended yet), or 0 after `timeout_seconds`."""
        give_up_at = time.monotonic() + timeout_seconds
        while time.monotonic() < give_up_at:
            counts = handoff_counts(self.stack)
            in_flight = handoffs_in_flight(counts)
            if in_flight > 0 and counts["started"] > self.started_at_last_kill:
                self.started_at_last_kill = counts["started"]
                return in_flight
            time.sleep(POLL_SECONDS)
        self.say(f"no new handoff in flight within {timeout_seconds:g} s: killing anyway")
        return 0.0

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started_at:7.1f} s] {message}", flush=True)


def table(args, cycles: Cycles, counts: dict[str, float], outcome, wall_seconds: float) -> str:
    ends = ", ".join(f"{k} {v:g}" for k, v in counts.items() if k != "started")
    header = [
        "cycles",
        "kills sender / receiver (mid-handoff)",
        "handoffs started",
        "handoffs by end",
        "submitted",
        "acknowledged",
        "lost",
        "duplicated tokens",
        "missing tokens",
        "wrong outputs",
        "wall time",
        "load average 1/5/15 min at the end",
    ]
    row = [
        str(args.cycles),
        f"{cycles.kills['sender']} / {cycles.kills['receiver']} ({cycles.kills_mid_handoff})",
        f"{counts['started']:g}",
        ends,
        str(outcome.submitted),
        str(outcome.acknowledged),
        str(outcome.lost),
        str(outcome.duplicated_tokens),
        str(outcome.missing_tokens),
        str(outcome.wrong_outputs),
        f"{wall_seconds:.0f} s",
        " / ".join(f"{x:.2f}" for x in os.getloadavg()),
    ]
    return markdown_table(header, [row])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.handoff_kills", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="4 cycles")
    parser.add_argument(
        "--sequences",
        type=int,
        default=0,
        help="jobs prepared for the stream (0: 40 per cycle); submissions stop after "
        "the last cycle",
    )
    parser.add_argument("--submit-interval-seconds", type=float, default=0.4)
    parser.add_argument("--decoders", type=int, default=2, help="decode workers")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--lease-ttl-ms", type=int, default=5000)
    parser.add_argument(
        "--cycle-timeout-seconds",
        type=float,
        default=120.0,
        help="how long a cycle waits for a handoff in flight, and for the workers",
    )
    parser.add_argument(
        "--deadline-seconds",
        type=float,
        default=3600.0,
        help="the clients' deadline for the whole run",
    )
    parser.add_argument("--keep", action="store_true", help="keep the process logs")
    args = parser.parse_args(argv)
    if args.quick:
        args.cycles = 4
    if args.cycles < 1 or args.decoders < 1:
        parser.error("--cycles and --decoders must be at least 1")
    args.sequences = args.sequences or 40 * args.cycles

    directory = Path(tempfile.mkdtemp(prefix="lattice-handoff-kills-"))
    started = time.monotonic()
    cycles = Cycles(args, directory)
    print(f"{len(cycles.jobs)} prompts prepared; stack and logs in {directory}", flush=True)
    try:
        cycles.run()
        counts = handoff_counts(cycles.stack)
        submitted = [j for j in cycles.jobs if j.first_sent_at is not None]
        print(f"reference engine: expected tokens of the {len(submitted)} jobs submitted")
        set_expected(submitted)
        outcome = check(cycles.stack.stub, cycles.jobs)
    finally:
        if cycles.clients is not None:
            cycles.clients.close()
        cycles.stack.close()
    wall_seconds = time.monotonic() - started
    return report_run(
        outcome,
        table(args, cycles, counts, outcome, wall_seconds),
        directory,
        keep=args.keep,
        kept="process logs",
    )


if __name__ == "__main__":
    sys.exit(main())
