#!/usr/bin/env python3
"""The cost of one decision in instructions (callgrind), next to nano-vllm's scheduler.

The workload (a worker decoding a full batch): one worker with R running sequences decoding, one new token per
running sequence per decision, 1,000 queued 512-token prompts, page size 16, a token
budget of 2,048, the `budget` policy. The running sequences' prompts are 512 + (i % 16)
tokens, so their page boundaries are spread evenly: each decision, about R/16 of them
start a page (nano-vllm allocates a block and hashes the full one then).

Cells, for R in 32, 128, 256:
  core      `Scheduler.select_batch` on a WorkerReport (core objects, no observer)
  served    the server's work in process: SelectBatchRequest bytes parsed,
            convert.worker_report -> select_batch -> convert.decision, the answer
            serialised; the core's observer is FanOut(SchedulerMetrics, Wakeups), as
            service/server/app.py wires it; the report's tokens as one TokenUpdate per
            sequence (the old form, no offsets)
  packed    the served path with the report's tokens in the packed arrays, with
            offsets, as the project's worker sends them (worker_client/convert.py)
  unchanged the packed cell with the running list left out (running_unchanged_since,
            the server's RunningLists) and the answer's decode list with it
            (decode_all_running), as the project's worker sends a steady step
  nano      (with --nano-vllm DIR) nano-vllm's Scheduler.schedule() + postprocess()
            from a local checkout, block size 16, its prefix hashing included

Instructions per decision: each cell runs in its own process under
`valgrind --tool=callgrind` twice, with N1 and N2 decisions after the same set-up, and
the figure is (Ir(N2) - Ir(N1)) / (N2 - N1): start-up, imports and set-up cancel (what
the set-up built is frozen out of the garbage collector first: a full collection in one
run of the pair and not the other would otherwise land in the figure). The
second column is time.process_time() per decision, measured in this process (no
valgrind) over the same steady state: it moves with the machine's load, instructions
do not.

nano-vllm, what is stubbed and why: its package `__init__` imports the LLM engine
(torch, transformers), so `nanovllm` is put in sys.modules as a bare package pointing at
DIR/nanovllm and only nanovllm.engine.{scheduler,block_manager,sequence} are imported;
nanovllm/config.py imports `AutoConfig` from transformers, stubbed as an empty module
with an empty class AutoConfig (Config itself is never built: its __post_init__ reads a model
directory and wants a block size that is a multiple of 256; Scheduler reads five
attributes from a plain namespace instead). The block manager's own imports are real:
xxhash (PyPI) and numpy. Sequence.block_size is set to 16.

nano-vllm never decodes while the queue's head fits in memory (its prefill comes first),
so in its steady state with 1,000 queued the head is held back by a full block pool, and
each schedule() pays one BlockManager.can_allocate(head) that fails. A full pool cannot
also give R/16 blocks per decision to the running sequences, so the nano cell runs
schedule() + postprocess() with the queue outside the scheduler and pool room for the
running sequences, and calls the scheduler's own block_manager.can_allocate on the
queued head (a 512-token prompt) once per decision: the same work, in the same code.

    .venv/bin/python -m bench.decision_cost --nano-vllm /tmp/nano-vllm
    .venv/bin/python -m bench.decision_cost --quick       # R = 32 only, short
    .venv/bin/python -m bench.decision_cost --kinds nano --n2 68 --nano-vllm DIR

Figures and the commit they ran at: docs/benchmarks.md, "The cost of a decision".
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path

from service.core import (
    Scheduler,
    SchedulerConfig,
    SubmitParams,
    TokenUpdate,
    WorkerRegistration,
    WorkerReport,
)

ROOT = Path(__file__).resolve().parent.parent

QUEUED = 1_000
PROMPT_LEN = 512
PAGE_SIZE = 16
TOKEN_BUDGET = 2_048
MAX_NEW_TOKENS = 3_000  # none finishes during a run
KV_PAGES = 10**6
WORKER_ID = "bench"
# Requests of the packed cell built in its set-up: its warm-up and runs must not pass it.
MAX_PACKED_STEPS = 600
WARMUP = 16  # decisions after the running set is full, before counting starts
# Under callgrind a set-up takes minutes: the worker's lease must not expire meanwhile.
LEASE_MS = 24 * 3600 * 1000
KINDS = ("core", "served", "packed", "unchanged", "nano")


def _prompt(rnd: random.Random, length: int) -> list[int]:
    """Tokens in 1..150,000, distinct prompts (no prefix shared); cheap to build, since the
    set-up runs under callgrind too."""
    start, stride = rnd.randrange(150_000), rnd.randrange(1, 150_000)
    return [(start + j * stride) % 150_000 + 1 for j in range(length)]


def _settle() -> None:
    """After a set-up: what it built is moved out of the collector's reach (gc.freeze), so
    a full collection that falls in one run's decisions and not the other's does not
    count as decisions' cost. Garbage the decisions make is still collected (and counted)."""
    gc.collect()
    gc.freeze()


def _running_prompt_len(i: int) -> int:
    return PROMPT_LEN + i % PAGE_SIZE


class CoreWorkload:
    """The core (or the served path) with `running` decoding and QUEUED queued.

    step() is one decision; the report is the same every decision (each running
    sequence got one token), built once, so only the decision is counted."""

    def __init__(
        self,
        running: int,
        served: bool,
        seed: int = 1,
        packed: bool = False,
        unchanged: bool = False,
    ) -> None:
        self.running_count = running
        self.served = served
        self.packed = packed or unchanged
        self.unchanged = unchanged
        self.since = 0  # the unchanged cell: the iteration its running list was sent at
        self.num_steps = 0
        rnd = random.Random(seed)
        observer = None
        if served:
            from prometheus_client import CollectorRegistry

            from service.server.metrics import SchedulerMetrics
            from service.server.observers import FanOut
            from service.server.wakeups import Wakeups

            observer = FanOut(SchedulerMetrics(CollectorRegistry()), Wakeups())
        config = SchedulerConfig(
            policy="budget",
            max_batch_size=running,
            max_num_batched_tokens=TOKEN_BUDGET,
            chunk_size=PROMPT_LEN,
            max_queue=QUEUED + running,
            lease_ttl_ms=LEASE_MS,
        )
        self.core = Scheduler(config, observer=observer)
        self.core.register_worker(
            WorkerRegistration(
                WORKER_ID,
                total_kv_pages=KV_PAGES,
                page_size=PAGE_SIZE,
                total_gdn_slots=running,
                max_batch_size=running,
            )
        )
        for i in range(running):
            self.core.submit(
                SubmitParams(
                    prompt_token_ids=_prompt(rnd, _running_prompt_len(i)),
                    max_new_tokens=MAX_NEW_TOKENS,
                )
            )
        self._fill(running)
        for _ in range(QUEUED):
            self.core.submit(
                SubmitParams(
                    prompt_token_ids=_prompt(rnd, PROMPT_LEN), max_new_tokens=MAX_NEW_TOKENS
                )
            )
        self.report = WorkerReport(
            WORKER_ID,
            running=self.running,
            kv_free_pages=KV_PAGES // 2,
            gdn_free_slots=0,
            tokens=tuple(TokenUpdate(seq_id, (7,)) for seq_id in self.running),
        )
        if served:
            from service.server import convert

            self._convert = convert
            self._request_type = type(self._request())
            self.request_bytes = self._request().SerializeToString()
            if unchanged:  # the running list sent once, in full, without tokens
                from service.server.running_lists import RunningLists

                self._lists = RunningLists()
                first = self._request_type(
                    worker_id=WORKER_ID,
                    running=self.running,
                    kv_free_pages=KV_PAGES // 2,
                    gdn_free_slots=0,
                )
                self._lists.answer(
                    first, self.running, self.core.select_batch(convert.worker_report(first))
                )
                self.since = self.core.status().workers[0].iteration
            if self.packed:  # one request per step (its offsets), built here: not counted
                self.packed_requests = []
                for self.num_steps in range(MAX_PACKED_STEPS):
                    self.packed_requests.append(self._request().SerializeToString())
                self.num_steps = 0
        self.last = None
        for _ in range(WARMUP):
            self.step()
        _settle()

    def _fill(self, running: int) -> None:
        """Admit and prefill the running set (the worker's side, as bench/policies.py)."""
        waiting: dict[int, int] = {}  # seq_id -> prompt length
        done: list[int] = []
        while len(done) < running:
            report = WorkerReport(
                WORKER_ID,
                waiting=tuple(waiting),
                running=tuple(done),
                kv_free_pages=KV_PAGES // 2,
                gdn_free_slots=running - len(waiting) - len(done),
            )
            decision = self.core.select_batch(report)
            for chunk in decision.prefill:
                if chunk.spec is not None:
                    waiting[chunk.seq_id] = len(chunk.spec.prompt_token_ids)
                if chunk.chunk_start + chunk.chunk_len >= waiting[chunk.seq_id]:
                    del waiting[chunk.seq_id]
                    done.append(chunk.seq_id)
        self.running = tuple(done)

    def _request(self):
        from lattice.scheduler.v1 import scheduler_pb2 as pb

        if self.packed:  # offsets as a worker sends them: the tokens known before these
            return pb.SelectBatchRequest(
                worker_id=WORKER_ID,
                running=() if self.since else self.running,
                kv_free_pages=KV_PAGES // 2,
                gdn_free_slots=0,
                token_seq_ids=self.running,
                token_ids=[7] * len(self.running),
                token_offsets=[self.num_steps] * len(self.running),
                running_unchanged_since=self.since,
                accepts_decode_all_running=self.unchanged,
            )
        return pb.SelectBatchRequest(
            worker_id=WORKER_ID,
            running=self.running,
            kv_free_pages=KV_PAGES // 2,
            gdn_free_slots=0,
            tokens=[pb.TokenUpdate(seq_id=seq_id, token_ids=[7]) for seq_id in self.running],
        )

    def step(self) -> None:
        if self.served:
            if self.packed:
                self.request_bytes = self.packed_requests[self.num_steps]
                self.num_steps += 1
            msg = self._request_type.FromString(self.request_bytes)
            if self.unchanged:
                running = self._lists.running(msg)
                decision = self.core.select_batch(self._convert.worker_report(msg, running))
                self.last = self._lists.answer(msg, running, decision).SerializeToString()
            else:
                decision = self.core.select_batch(self._convert.worker_report(msg))
                self.last = self._convert.decision(decision).SerializeToString()
            self.last_decision = decision
        else:
            self.last_decision = self.core.select_batch(self.report)

    def check(self) -> None:
        """The last decision decoded every running sequence and admitted none."""
        d = self.last_decision
        if tuple(d.decode) != self.running or d.prefill or d.evict or d.preempt:
            raise SystemExit(
                f"set-up is wrong (R = {self.running_count}): the decision is not "
                "'decode all, admit none'"
            )
        if self.core.status().queue_depth != QUEUED:
            raise SystemExit(f"set-up is wrong: {self.core.status().queue_depth} queued")


def import_nano(directory: Path) -> types.SimpleNamespace:
    """nano-vllm's scheduler modules from a checkout, without torch or transformers."""
    package_dir = directory / "nanovllm"
    if not (package_dir / "engine" / "scheduler.py").is_file():
        raise SystemExit(f"--nano-vllm: {directory} has no nanovllm/engine/scheduler.py")
    if "transformers" not in sys.modules:
        stub = types.ModuleType("transformers")
        stub.AutoConfig = type("AutoConfig", (), {})  # config.py's annotation only
        sys.modules["transformers"] = stub
    package = types.ModuleType("nanovllm")
    package.__path__ = [str(package_dir)]
    sys.modules["nanovllm"] = package
    from nanovllm import sampling_params as params
    from nanovllm.engine import scheduler, sequence

    sequence.Sequence.block_size = PAGE_SIZE
    return types.SimpleNamespace(
        Scheduler=scheduler.Scheduler,
        Sequence=sequence.Sequence,
        SamplingParams=params.SamplingParams,
    )


class NanoWorkload:
    """nano-vllm's Scheduler with `running` decoding; see the module docstring."""

    def __init__(self, running: int, directory: Path, seed: int = 1) -> None:
        nano = import_nano(directory)
        self.running_count = running
        rnd = random.Random(seed)
        # Room for every running sequence to grow by 1,024 tokens: no preemption in a run.
        blocks = running * ((PROMPT_LEN + PAGE_SIZE + 1024) // PAGE_SIZE + 1)
        config = types.SimpleNamespace(
            max_num_seqs=running,
            max_num_batched_tokens=TOKEN_BUDGET,
            eos=-1,
            kvcache_block_size=PAGE_SIZE,
            num_kvcache_blocks=blocks,
        )
        self.scheduler = nano.Scheduler(config)
        params = nano.SamplingParams(max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        for i in range(running):
            self.scheduler.add(nano.Sequence(_prompt(rnd, _running_prompt_len(i)), params))
        while self.scheduler.waiting:  # its own prefill steps
            seqs, is_prefill = self.scheduler.schedule()
            self.scheduler.postprocess(seqs, [7] * len(seqs), is_prefill)
        self.queued = [nano.Sequence(_prompt(rnd, PROMPT_LEN), params) for _ in range(QUEUED)]
        self.tokens = [7] * running
        self.last = None
        for _ in range(WARMUP):
            self.step()
        _settle()

    def step(self) -> None:
        manager = self.scheduler.block_manager
        manager.can_allocate(self.queued[0])  # the held-back head, as schedule() checks it
        seqs, is_prefill = self.scheduler.schedule()
        self.scheduler.postprocess(seqs, self.tokens, is_prefill)
        self.last = (len(seqs), is_prefill)

    def check(self) -> None:
        if self.last != (self.running_count, False) or self.scheduler.waiting:
            raise SystemExit(f"nano set-up is wrong (R = {self.running_count}): {self.last}")


def build(kind: str, running: int, nano_dir: Path | None):
    if kind == "nano":
        if nano_dir is None:
            raise SystemExit("the nano cell needs --nano-vllm DIR")
        return NanoWorkload(running, nano_dir)
    return CoreWorkload(
        running,
        served=kind in ("served", "packed", "unchanged"),
        packed=kind == "packed",
        unchanged=kind == "unchanged",
    )


def run_cell(kind: str, running: int, decisions: int, nano_dir: Path | None) -> None:
    """The child under callgrind: set-up, then `decisions` decisions."""
    workload = build(kind, running, nano_dir)
    step = workload.step
    for _ in range(decisions):
        step()
    workload.check()


def callgrind_instructions(kind: str, running: int, decisions: int, nano_dir: Path | None) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        command = [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            sys.executable,
            "-m",
            "bench.decision_cost",
            "--cell",
            kind,
            str(running),
            str(decisions),
        ]
        if nano_dir is not None:
            command += ["--nano-vllm", str(nano_dir)]
        env = dict(os.environ, PYTHONHASHSEED="0")
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
        if done.returncode != 0:
            raise SystemExit(f"{kind} R={running} N={decisions} failed:\n{done.stderr[-3000:]}")
        for line in out.read_text().splitlines():
            if line.startswith("summary:") or line.startswith("totals:"):
                return int(line.split()[1])
        raise SystemExit(f"no summary line in {out}")


def cpu_per_decision(kind: str, running: int, decisions: int, nano_dir: Path | None) -> float:
    workload = build(kind, running, nano_dir)
    step = workload.step
    started = time.process_time()
    for _ in range(decisions):
        step()
    elapsed = time.process_time() - started
    workload.check()
    return elapsed / decisions


@dataclass
class Row:
    kind: str
    running: int
    instructions: float
    cpu_seconds: float


def _fmt_count(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.decision_cost", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--nano-vllm",
        type=Path,
        default=None,
        metavar="DIR",
        help="a nano-vllm checkout (GeeeekExplorer/nano-vllm): adds its cells",
    )
    parser.add_argument(
        "--quick", action="store_true", help="R = 32 only, N1 = 4, N2 = 20 (a check that it runs)"
    )
    parser.add_argument(
        "--running",
        type=int,
        nargs="+",
        default=[32, 128, 256],
        help="running sequences per cell (default 32 128 256)",
    )
    parser.add_argument("--n1", type=int, default=4, help="decisions of the short run")
    # 16 decisions between the pair was too few for nano-vllm (docs/benchmarks.md).
    parser.add_argument("--n2", type=int, default=68, help="decisions of the long run")
    parser.add_argument(
        "--cpu-decisions",
        type=int,
        default=200,
        help="decisions timed with process_time per cell (default 200)",
    )
    parser.add_argument(
        "--kinds",
        nargs="+",
        choices=KINDS,
        default=list(KINDS),
        help="cells to run (default all; nano only with --nano-vllm)",
    )
    parser.add_argument("--cell", nargs=3, metavar=("KIND", "R", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:
        kind, running, decisions = args.cell[0], int(args.cell[1]), int(args.cell[2])
        run_cell(kind, running, decisions, args.nano_vllm)
        return 0
    if args.quick:
        args.running, args.n1, args.n2, args.cpu_decisions = [32], 4, 20, 50
    if not 0 <= args.n1 < args.n2:
        parser.error("need 0 <= --n1 < --n2")
    if {"packed", "unchanged"} & set(args.kinds) and max(
        args.n2, args.cpu_decisions
    ) + WARMUP > MAX_PACKED_STEPS:
        parser.error(f"the packed cell runs at most {MAX_PACKED_STEPS - WARMUP} decisions")
    if min(args.running) < 1:
        parser.error("--running: each must be >= 1")
    kinds = [k for k in args.kinds if k != "nano" or args.nano_vllm is not None]
    started = time.monotonic()
    rows: list[Row] = []
    for running in args.running:
        for kind in kinds:
            print(
                f"[{time.monotonic() - started:6.0f}s] {kind} R={running}: "
                f"callgrind N={args.n1}, N={args.n2}, then process_time",
                flush=True,
            )
            low = callgrind_instructions(kind, running, args.n1, args.nano_vllm)
            high = callgrind_instructions(kind, running, args.n2, args.nano_vllm)
            per = (high - low) / (args.n2 - args.n1)
            cpu = cpu_per_decision(kind, running, args.cpu_decisions, args.nano_vllm)
            rows.append(Row(kind, running, per, cpu))
            print(
                f"         {_fmt_count(per)} instructions, {cpu * 1e3:.3f} ms CPU per decision",
                flush=True,
            )
    print()
    print(
        f"Instructions per decision (callgrind, (Ir(N={args.n2}) - Ir(N={args.n1})) / "
        f"{args.n2 - args.n1}); CPU ms per decision (process_time, {args.cpu_decisions} "
        "decisions, this machine's load)"
    )
    print(f"{'R':>5}{'kind':>11}{'instr':>10}{'x nano':>8}{'CPU ms':>9}{'x nano':>8}")
    nano = {r.running: r for r in rows if r.kind == "nano"}
    for row in rows:
        ref = nano.get(row.running)
        ratio = f"{row.instructions / ref.instructions:.2f}" if ref else "-"
        cpu_ratio = f"{row.cpu_seconds / ref.cpu_seconds:.2f}" if ref else "-"
        print(
            f"{row.running:>5}{row.kind:>11}{_fmt_count(row.instructions):>10}{ratio:>8}"
            f"{row.cpu_seconds * 1e3:>9.3f}{cpu_ratio:>8}"
        )
    print(f"wall time {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
