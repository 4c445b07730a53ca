"""Prefill/decode disaggregation on the real CPU stack (issue 31's target: "2 workers,
long prompts mixed with decodes at a fixed load: TPOT p99 with 1P1D vs 2 co-located").

A `lattice-scheduler serve` process and two `lattice-worker --model small|tiny` processes
(the reference engine, seeded random Qwen3.5 weights, CPU): once as two co-located workers
(`--role both`), once as one prefill and one decode worker (`--role prefill` / `decode`,
handoff channels on loopback). The same arrival trace against each: Poisson arrivals, a
mix of long prompts (--long-tokens, above the scheduler's 1,024-token handoff threshold)
and short ones, every request --max-new-tokens output tokens (ignore_eos), so decodes
overlap the long prefills. Prints side by side: TTFT p50/p99, TPOT p50/p99 (per request,
(end - first token) / (tokens - 1)), output tokens per second, prompt tokens computed per
worker (the scheduler's lattice_scheduler_worker_prefill_tokens_total) and handoffs by
how they ended (lattice_scheduler_handoffs_total), each worker's CPU time over the trace's
wall time (its utilisation), with the load average. Then two tables: the token gaps at
the client per setup and kind of prompt (long: past 1,024 tokens, handed off in 1P1D;
short), the first-to-second gap apart from the gaps after it;
and, for the handed-off requests, the handoff's timeline from the workers' log lines
(worker_client/handoffs.py): each step's time after the request's first token reached the
client, p50 / p99 (negative: before it), up to its second token.

    .venv/bin/python -m bench.disagg --quick
    .venv/bin/python -m bench.disagg --setups 1P1D     # one setup (an A/B of two trees)
    .venv/bin/python -m bench.disagg --model tiny      # the earlier figures' model
    .venv/bin/python -m bench.disagg --step-costs      # each model's step costs, CPU time
    .venv/bin/python -m bench.disagg --pin-cpus        # worker i on CPU i (taskset)

The model (--model, default small): `small` (hidden 512, 8 layers, 35M parameters), whose
2,048-token prompt costs ~3 s of CPU and a 512-token chunk as much as ~18 decode steps of
4 sequences, so that a long prompt's chunks stall the decodes that share its steps by far
more than the stack's own per-step cost, as a real model's prefill does; `tiny` (hidden
64, 4 layers), whose 512-token chunk costs ~45 ms, so a decode behind it loses little
beside the stack's per-step overhead, and there is little interference for
disaggregation to remove. Each model has its default --qps (MODELS).

What it does not show: the scheduler and both workers share this machine's cores (2 on
the development box), so the prefill worker's compute slows the decode worker's as much
as a co-located prefill would; the figure shows the mechanism's cost and where prompts
ran, not the overlap two accelerators would give.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from dataclasses import dataclass, field

import grpc

from bench.harness.processes import (
    Proc,
    Scheduler,
    start_scheduler,
    stop_all,
    wait_for_workers,
)
from bench.harness.tables import load_note, pct, print_table
from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc

SETUPS = {
    "2 co-located": ("both", "both"),
    "1P1D": ("prefill", "decode"),
}


@dataclass(frozen=True)
class ModelSetting:
    """A `--model` preset and the arrival rate of its default trace."""

    description: str
    # Loads two co-located workers without overloading them: each busy a third to a half
    # of the trace's wall time on 2 shared cores (docs/disaggregation.md).
    qps: float


MODELS = {
    "small": ModelSetting("small Qwen3.5 (hidden 512, 6 GDN + 2 attention layers)", qps=0.3),
    "tiny": ModelSetting("tiny Qwen3.5 (hidden 64, 3 GDN + 1 attention layers)", qps=0.5),
}


@dataclass(frozen=True)
class Arrival:
    at_seconds: float
    prompt: list[int]


@dataclass
class Outcome:
    ttft_seconds: float | None = None
    e2e_seconds: float = 0.0
    num_tokens: int = 0
    error: str = ""
    seq_id: int = 0
    long: bool = False
    # Wall-clock time (time.time()) each token arrived at the client, in order.
    token_times: list[float] = field(default_factory=list)


@dataclass
class Result:
    outcomes: list[Outcome] = field(default_factory=list)
    wall_seconds: float = 0.0
    prompt_tokens: dict[str, float] = field(default_factory=dict)
    handoffs: dict[str, float] = field(default_factory=dict)
    # Sequences sent back to the queue, and preempted, by reason.
    requeues: dict[str, float] = field(default_factory=dict)
    load: str = ""
    # By seq_id, the handoff's timeline from the workers' logs: event -> wall-clock time.
    timelines: dict[int, dict[str, float]] = field(default_factory=dict)
    # By worker id, its process's CPU seconds over the trace (from /proc).
    worker_cpu_seconds: dict[str, float] = field(default_factory=dict)


def trace(args) -> list[Arrival]:
    """Poisson arrivals at --qps; a --long-share of the prompts --long-tokens long, the
    others --short-tokens."""
    rng = random.Random(args.seed)
    at, arrivals = 0.0, []
    for _ in range(args.num_requests):
        at += rng.expovariate(args.qps)
        length = args.long_tokens if rng.random() < args.long_share else args.short_tokens
        arrivals.append(Arrival(at, [rng.randrange(2, 500) for _ in range(length)]))
    return arrivals


def _worker(scheduler: Scheduler, index: int, role: str, args) -> Proc:
    argv = [
        sys.executable, "-m", "worker_client",
        "--scheduler", scheduler.target,
        "--worker-id", f"{role}-{index}",
        "--model", args.model,
        "--device", "cpu",
        "--threads", str(args.threads),
        "--kv-pages", str(args.kv_pages),
        "--gdn-slots", str(args.gdn_slots),
        "--log-format", "json",
        "--role", role,
    ]  # fmt: skip
    if role != "both":
        argv += ["--handoff-port", "0", "--transfer-gb-per-s", str(args.transfer_gb_per_s)]
    if args.pin_cpus:
        # Worker i on CPU i (mod the machine's): each worker a core of its own, as each
        # would have its accelerator; the scheduler and the load generator float.
        argv = ["taskset", "-c", str(index % os.cpu_count()), *argv]
    return Proc(argv)


def _one(stub, arrival: Arrival, args, started: float, outcome: Outcome) -> None:
    time.sleep(max(0.0, started + arrival.at_seconds - time.perf_counter()))
    sent = time.perf_counter()
    try:
        for event in stub.Generate(
            pb.SubmitRequest(
                prompt_token_ids=arrival.prompt,
                max_new_tokens=args.max_new_tokens,
                sampling=pb.SamplingParams(ignore_eos=True),
            ),
            timeout=args.request_timeout_s,
        ):
            outcome.seq_id = event.seq_id
            if event.token_ids and outcome.ttft_seconds is None:
                outcome.ttft_seconds = time.perf_counter() - sent
            outcome.num_tokens += len(event.token_ids)
            outcome.token_times += [time.time()] * len(event.token_ids)
    except grpc.RpcError as exc:
        outcome.error = exc.code().name
    outcome.e2e_seconds = time.perf_counter() - sent


def run(roles: tuple[str, str], arrivals: list[Arrival], args) -> Result:
    scheduler = start_scheduler()
    workers = [_worker(scheduler, i, role, args) for i, role in enumerate(roles)]
    channel = grpc.insecure_channel(scheduler.target)
    stub = pb_grpc.SchedulerStub(channel)
    result = Result(outcomes=[Outcome(long=len(a.prompt) >= 1024) for a in arrivals])
    try:
        wait_for_workers(stub, len(workers), timeout_seconds=180)
        # One short request first, so that both setups start with warm engines.
        stub.Generate(pb.SubmitRequest(prompt_token_ids=[3] * 16, max_new_tokens=2), timeout=120)
        cpu_before = [w.cpu_seconds() for w in workers]
        started = time.perf_counter()
        threads = [
            threading.Thread(target=_one, args=(stub, a, args, started, o))
            for a, o in zip(arrivals, result.outcomes)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        result.wall_seconds = time.perf_counter() - started
        result.worker_cpu_seconds = {
            f"{role}-{i}": w.cpu_seconds() - before
            for i, (role, w, before) in enumerate(zip(roles, workers, cpu_before))
        }
        result.load = load_note()
        result.prompt_tokens = {
            dict(labels)["worker_id"]: value
            for labels, value in _summed(
                scheduler.samples("lattice_scheduler_worker_prefill_tokens_total"), "worker_id"
            ).items()
        }
        result.handoffs = {
            dict(labels)["end"]: value
            for labels, value in scheduler.samples("lattice_scheduler_handoffs_total").items()
        }
        for name in ("requeues", "preemptions"):
            for labels, value in scheduler.samples(f"lattice_scheduler_{name}_total").items():
                if value:
                    result.requeues[f"{name[:-1]} {dict(labels)['reason']}"] = value
        result.timelines = timelines(w.log_text() for w in workers)
    finally:
        channel.close()
        stop_all(*workers, scheduler.proc)
    return result


# The workers' log lines of a handoff (worker_client/handoffs.py): their time fields, by
# the name of the step in the handoff's timeline, in the order they happen.
_TIMELINE_FIELDS = {
    "handoff offered": {"decided_at": "SEND decision at sender", "offered_at": "SEND applied"},
    "handoff imported": {
        "decided_at": "RECEIVE decision at receiver",
        "received_at": "RECEIVE applied",
        "fetch_started_at": "fetch started",
        "fetch_ended_at": "fetch ended",
        "imported_at": "imported",
    },
    "handoff first decode": {"decode_at": "first decode on receiver"},
}
TIMELINE = [name for fields in _TIMELINE_FIELDS.values() for name in fields.values()]


def timelines(logs) -> dict[int, dict[str, float]]:
    """By seq_id, the wall-clock time of each step of its handoff, from the workers' JSON
    logs (of its last handoff, when it had more than one)."""
    found: dict[int, dict[str, float]] = {}
    for text in logs:
        for line in text.splitlines():
            if not line.startswith("{") or '"handoff ' not in line:
                continue
            entry = json.loads(line)
            fields = _TIMELINE_FIELDS.get(entry.get("message"), {})
            times = found.setdefault(int(entry.get("seq_id", -1)), {})
            times.update({name: float(entry[f]) for f, name in fields.items() if f in entry})
    return found


def _summed(samples: dict[tuple, float], key: str) -> dict[tuple, float]:
    """Samples added up over every label but `key`."""
    totals: dict[tuple, float] = {}
    for labels, value in samples.items():
        k = ((key, dict(labels)[key]),)
        totals[k] = totals.get(k, 0.0) + value
    return totals


def _row(label: str, result: Result) -> list[object]:
    ok = [o for o in result.outcomes if not o.error and o.ttft_seconds is not None]
    ttft = [o.ttft_seconds for o in ok]
    tpot = [(o.e2e_seconds - o.ttft_seconds) / (o.num_tokens - 1) for o in ok if o.num_tokens > 1]
    tokens = sum(o.num_tokens for o in ok)
    done = result.handoffs.get("done", 0.0)
    failed = " ".join(
        f"{end}={v:.0f}" for end, v in sorted(result.handoffs.items()) if end != "done" and v
    )
    return [
        label,
        f"{pct(ttft, 50) * 1000:.0f} / {pct(ttft, 99) * 1000:.0f}" if ttft else "-",
        f"{pct(tpot, 50) * 1000:.1f} / {pct(tpot, 99) * 1000:.1f}" if tpot else "-",
        f"{tokens / result.wall_seconds:.1f}",
        " ".join(f"{w}={v:.0f}" for w, v in sorted(result.prompt_tokens.items())),
        f"{done:.0f} / {failed or 0}",
        " ".join(f"{k}={v:.0f}" for k, v in sorted(result.requeues.items())) or "-",
        " ".join(
            f"{w}={v / result.wall_seconds:.2f}"
            for w, v in sorted(result.worker_cpu_seconds.items())
        ),
        len(result.outcomes) - len(ok),
    ]


def _p50_p99(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{pct(values, 50) * 1000:.1f} / {pct(values, 99) * 1000:.1f}"


def _gap_rows(label: str, result: Result) -> list[list[object]]:
    """Per kind of prompt: the gap between the first and second token at the client, the
    gaps after it, and TPOT (their mean per request)."""
    rows = []
    for kind, long in (("long", True), ("short", False)):
        ok = [
            o for o in result.outcomes
            if o.long is long and not o.error and len(o.token_times) > 2
        ]  # fmt: skip
        handed_off = sum("imported" in result.timelines.get(o.seq_id, {}) for o in ok)
        first = [o.token_times[1] - o.token_times[0] for o in ok]
        later = [b - a for o in ok for a, b in zip(o.token_times[1:], o.token_times[2:])]
        tpot = [(o.token_times[-1] - o.token_times[0]) / (len(o.token_times) - 1) for o in ok]
        rows.append(
            [
                f"{label}, {kind}",
                f"{len(ok)} ({handed_off})",
                _p50_p99(first),
                _p50_p99(later),
                _p50_p99(tpot),
            ]
        )
    return rows


def _timeline_rows(result: Result) -> list[list[object]]:
    """For each handed-off request: each step of its handoff, in ms after its first token
    reached the client, then its second token."""
    steps: dict[str, list[float]] = {name: [] for name in [*TIMELINE, "second token at client"]}
    for o in result.outcomes:
        times = result.timelines.get(o.seq_id, {})
        if "imported" not in times or len(o.token_times) < 2:
            continue
        times = {**times, "second token at client": o.token_times[1]}
        for name, values in steps.items():
            if name in times:
                values.append(times[name] - o.token_times[0])
    return [[name, len(values), _p50_p99(values)] for name, values in steps.items() if values]


def _prefill(engine, seq_id: int, length: int) -> None:
    """Prefill a `length`-token prompt as `seq_id`, in chunks of 512."""
    from worker_client.engine.api import ChunkWork, SequenceSpec

    spec = SequenceSpec(tuple([7] * length), max_new_tokens=1 << 20, ignore_eos=True)
    for start in range(0, length, 512):
        engine.step(
            [ChunkWork(seq_id, start, min(512, length - start), spec if not start else None)], []
        )


def step_costs(args) -> None:
    """For each model, in this process's CPU time at one torch thread: a --long-tokens
    prompt prefilled in chunks of 512 (the scheduler's default chunk), and a decode step of
    1, 4 and 8 sequences of --short-tokens context; how many such steps the prefill costs."""
    import torch

    from worker_client.engine.engine import ModelEngine
    from worker_client.engine.loading import load_model

    torch.set_num_threads(args.threads)
    rows = []
    for name in MODELS:
        engine = ModelEngine(
            load_model(name),
            total_kv_pages=args.kv_pages,
            page_size=16,
            total_gdn_slots=16,
            device="cpu",
        )

        _prefill(engine, 0, args.short_tokens)  # warm-up
        started = time.process_time()
        _prefill(engine, 1, args.long_tokens)
        prefill = time.process_time() - started
        for seq_id in range(2, 10):
            _prefill(engine, seq_id, args.short_tokens)
        decode = {}
        for size in (1, 4, 8):
            started = time.process_time()
            for _ in range(5):
                engine.step([], list(range(2, 2 + size)))
            decode[size] = (time.process_time() - started) / 5
        rows.append(
            [
                name,
                f"{prefill:.2f}",
                " / ".join(f"{decode[n] * 1000:.1f}" for n in (1, 4, 8)),
                f"{prefill / decode[4]:.0f}",
            ]
        )
    print(f"CPU time, {args.threads} torch thread(s); {load_note()}")
    print_table(
        [
            "model",
            f"prefill {args.long_tokens} tokens s",
            "decode step of 1 / 4 / 8 ms",
            "prefill / decode step of 4",
        ],
        rows,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.disagg", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="a short trace (a few minutes)")
    parser.add_argument("--num-requests", type=int, default=60)
    parser.add_argument("--model", default="small", choices=list(MODELS))
    parser.add_argument("--qps", type=float, help="arrival rate (default: the model's, MODELS)")
    parser.add_argument("--long-share", type=float, default=0.3)
    parser.add_argument("--long-tokens", type=int, default=2048)
    parser.add_argument("--short-tokens", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--kv-pages", type=int, default=2048)
    # Room for every sequence of the trace on the one decode worker of 1P1D (the CPU
    # default is 8 GDN slots a worker, which a loaded decode worker outgrows).
    parser.add_argument("--gdn-slots", type=int, default=32)
    parser.add_argument(
        "--pin-cpus",
        action="store_true",
        help="each worker pinned to a CPU of its own (taskset; the scheduler floats)",
    )
    parser.add_argument("--transfer-gb-per-s", type=float, default=1.0)
    parser.add_argument("--request-timeout-s", type=float, default=600.0)
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--step-costs",
        action="store_true",
        help="print each model's prefill and decode step costs (CPU time) and exit",
    )
    args = parser.parse_args(argv)
    if args.step_costs:
        step_costs(args)
        return 0
    if args.quick:
        args.num_requests, args.max_new_tokens = 16, 32
    if args.qps is None:
        args.qps = MODELS[args.model].qps
    arrivals = trace(args)
    num_long = sum(len(a.prompt) == args.long_tokens for a in arrivals)
    print(
        f"{len(arrivals)} requests, Poisson at {args.qps} /s, {num_long} of "
        f"{args.long_tokens} tokens, the others {args.short_tokens}, {args.max_new_tokens} "
        f"output tokens each; {MODELS[args.model].description} on CPU, {args.threads} torch "
        f"thread(s) a worker"
    )
    rows, gap_rows, timeline_rows = [], [], []
    for label in args.setups:
        result = run(SETUPS[label], arrivals, args)
        print(f"{label}: {result.wall_seconds:.1f} s {result.load}", flush=True)
        rows.append(_row(label, result))
        gap_rows += _gap_rows(label, result)
        if result.timelines:
            timeline_rows = _timeline_rows(result)
    print_table(
        [
            "setup",
            "TTFT p50 / p99 ms",
            "TPOT p50 / p99 ms",
            "out tok/s",
            "prompt tokens per worker",
            "handoffs done / failed",
            "requeued, preempted",
            "worker CPU s / wall s",
            "errors",
        ],
        rows,
    )
    print("\nToken gaps at the client, ms (requests: done, of which handed off)")
    print_table(
        ["setup, prompts", "requests", "1st->2nd p50 / p99", "later p50 / p99", "TPOT p50 / p99"],
        gap_rows,
    )
    if timeline_rows:
        print("\nHandoff timeline, ms after the first token reached the client (1P1D)")
        print_table(["step", "handoffs", "p50 / p99"], timeline_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
