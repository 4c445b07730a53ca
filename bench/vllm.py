"""vLLM workers behind Lattice against plain vLLM, side by side, on one machine.

    .venv/bin/python -m bench.vllm [--model DIR] [--quick] [--only decisions --rounds N]

Needs .venv-vllm (scripts/setup.sh --engine vllm). One run, one table:
- overhead: one vLLM worker behind Lattice (scheduler, worker, gateway) against one plain
  `vllm serve` (vLLM's own scheduler), the same load generator (streamed chat completions
  with the `openai` client, greedy, ignore_eos): output tokens/s at saturation, TTFT and
  TPOT p50/p99 at a fixed low load;
- decisions: two vLLM workers behind Lattice (one queue, placement, the learned budget)
  against two plain `vllm serve` behind a round-robin router and behind a prefix-aware one
  (bench/router.py), on multi-turn conversations whose groups share a long system prompt:
  throughput and TTFT p99 at the same load. With --rounds N the three stacks run N times,
  each round in an order rotated by one; the targets' ratios come from each stack's
  medians over the rounds.
Every server runs the same checkpoint (default: the demo checkpoint with wider heads,
built under .artifacts/), bfloat16, eager, prefix caching on, 1 GiB of KV pool, 2,048
tokens a step; each of two servers gets its own CPU cores (VLLM_CPU_OMP_THREADS_BIND).
Under each table, where the time went: CPU seconds by process (/proc, children included)
over the load, output tokens per CPU second (the comparison at equal CPU), engine steps
and their tokens, prompt tokens computed (not taken from a prefix cache).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.harness.processes import ROOT
from bench.router import Router, serve
from common.processes import (
    GATEWAY_LISTENING,
    LOOPBACK,
    SCHEDULER_LISTENING,
    Process,
    clean_env,
    free_port,
    gateway_argv,
    scheduler_argv,
    spawn,
    worker_argv,
)
from common.waiting import wait_until

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MODEL = ROOT / ".artifacts" / "bench-vllm-model"
MAX_MODEL_LEN = 2048
# Tokens per engine step on every server (vLLM's own default for `vllm serve` on a CPU);
# a Lattice vLLM worker registers it, and the scheduler's budget for it is the same.
STEP_TOKENS = 2048
START_SECONDS = 300.0
# How long a stopped stack's processes may take to exit before they count as left running.
ENDED_SECONDS = 20.0
WORDS = (
    "scheduler queue worker page block prefix cache token chunk decode prefill state "
    "attention delta gate lease budget placement fleet replica step batch"
).split()


@dataclass
class Request:
    ttft: float | None = None
    e2e: float = 0.0
    tokens: int = 0
    error: str = ""
    turn: int = 0  # its place in its conversation, 1 first
    sent: float = 0.0  # seconds into the load when it was sent
    sent_at: float = 0.0  # wall clock (time.time()) when it was sent
    seq_id: int | None = None  # Lattice's, from the answer's id (chatcmpl-<seq_id>)
    prompt_tokens: int = 0


@dataclass
class Stack:
    """A running stack: where to send requests, its processes by role, its step counts."""

    url: str
    pids: dict[str, int]
    # () -> (engine steps, tokens run in them, prompt tokens computed rather than taken
    # from a prefix cache), summed over the stack's servers so far
    steps: Callable[[], tuple[float, float, float]]


@dataclass
class Load:
    """What one load measured."""

    wall: float
    started_at: float = 0.0  # wall clock (time.time()) when the load started
    requests: list[Request] = field(default_factory=list)
    cpu_seconds: dict[str, float] = field(default_factory=dict)  # by process role
    num_steps: float = 0.0
    num_step_tokens: float = 0.0
    num_computed_prompt_tokens: float = 0.0
    # The 1-minute load average when the stack was started and when the load had run.
    load_average: tuple[float, float] = (float("nan"), float("nan"))

    @property
    def ok(self) -> list[Request]:
        return [r for r in self.requests if not r.error and r.ttft is not None]

    @property
    def tokens_per_second(self) -> float:
        return sum(r.tokens for r in self.ok) / self.wall

    def ttft(self, q: float) -> float:
        return _quantile([r.ttft for r in self.ok], q)

    def tpot(self, q: float) -> float:
        return _quantile([(r.e2e - r.ttft) / (r.tokens - 1) for r in self.ok if r.tokens > 1], q)


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def run_conversations(
    base_url: str,
    model: str,
    conversations: list[list[list[dict]]],
    concurrency: int,
    max_tokens: int,
) -> Load:
    """Each conversation's turns in order (a turn: the messages it adds), `concurrency`
    conversations at a time; a turn carries the conversation so far."""
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600)
    load = Load(0.0)
    queue = list(range(len(conversations)))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                index = queue.pop(0)
            messages: list[dict] = []
            for number, turn in enumerate(conversations[index], 1):
                messages += turn
                started = time.perf_counter()
                request = Request(turn=number, sent=started - load_started, sent_at=time.time())
                with lock:
                    load.requests.append(request)
                pieces = []
                try:
                    stream = client.chat.completions.create(
                        model=model,
                        messages=messages,
                        max_tokens=max_tokens,
                        temperature=0,
                        stream=True,
                        stream_options={"include_usage": True},
                        extra_body={"ignore_eos": True},
                    )
                    for chunk in stream:
                        if request.seq_id is None:
                            request.seq_id = _seq_id(chunk.id)
                        if chunk.choices and chunk.choices[0].delta.content:
                            if request.ttft is None:
                                request.ttft = time.perf_counter() - started
                            pieces.append(chunk.choices[0].delta.content)
                        if chunk.usage is not None:
                            request.tokens = chunk.usage.completion_tokens
                            request.prompt_tokens = chunk.usage.prompt_tokens
                except openai.APIError as err:
                    request.error = str(err)
                request.e2e = time.perf_counter() - started
                messages = [*messages, {"role": "assistant", "content": "".join(pieces)}]

    started = load_started = time.perf_counter()
    load.started_at = time.time()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    load.wall = time.perf_counter() - started
    client.close()
    return load


def _seq_id(answer_id: str) -> int | None:
    """Lattice's seq_id in an answer's id (chatcmpl-<seq_id>); None for vLLM's ids."""
    tail = answer_id.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


def measured(stack: Stack, run: Callable[[], Load]) -> Load:
    """`run`, with the CPU time each process of `stack` (its children included) and the
    load generator (with the router, in this process) spent, and the steps run."""
    before_cpu = {role: process_cpu_seconds(pid) for role, pid in stack.pids.items()}
    before_own = time.process_time()
    before_steps = stack.steps()
    load = run()
    load.cpu_seconds = {
        role: process_cpu_seconds(pid) - before_cpu[role] for role, pid in stack.pids.items()
    }
    load.cpu_seconds["load generator"] = time.process_time() - before_own
    after_steps = stack.steps()
    load.num_steps = after_steps[0] - before_steps[0]
    load.num_step_tokens = after_steps[1] - before_steps[1]
    load.num_computed_prompt_tokens = after_steps[2] - before_steps[2]
    return load


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and its living descendants, from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for current, _ in process_tree(pid):
        fields = _stat_fields(current)
        if fields is not None:
            total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return total


def _left_running(started: dict[int, int], wait_seconds: float) -> dict[int, str]:
    """Those of `started` (pid: start time) still running after `wait_seconds` (a server's
    children may finish shutting down after it), with their command names."""
    deadline = time.monotonic() + wait_seconds
    while True:
        left = [pid for pid, start in started.items() if _start_time(pid) == start]
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    names = {}
    for pid in left:
        with contextlib.suppress(OSError):
            names[pid] = Path(f"/proc/{pid}/comm").read_text().strip()
    return names


def process_tree(pid: int) -> list[tuple[int, int]]:
    """`pid` and its living descendants, each with its start time (clock ticks after boot:
    a pid reused later has another), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        start = _start_time(current)
        if start is not None:
            tree.append((current, start))
            todo += children.get(current, [])
    return tree


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first); None: it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks after boot); None: it is gone, or a zombie."""
    fields = _stat_fields(pid)
    return None if fields is None or fields[0] == "Z" else int(fields[19])


def independent(num: int, seed: int) -> list[list[list[dict]]]:
    rng = random.Random(seed)
    return [[[{"role": "user", "content": _text(rng, 60)}]] for _ in range(num)]


def shared_prefix(num_groups: int, per_group: int, turns: int, seed: int) -> list:
    """Conversations in groups; a group's share one long system prompt."""
    rng = random.Random(seed)
    conversations = []
    for g in range(num_groups):
        system = f"({g}) " + _text(rng, 150)
        for c in range(per_group):
            first = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"[{c}] " + _text(rng, 20)},
            ]
            later = [[{"role": "user", "content": _text(rng, 12)}] for _ in range(turns - 1)]
            conversations.append([first, *later])
    rng.shuffle(conversations)
    return conversations


def _cores(index: int, count: int) -> str:
    """The cores of server `index` of `count` (all of them for one server)."""
    cpus = os.cpu_count() or 1
    share = max(1, cpus // count)
    first = index * share % cpus
    return f"{first}-{first + share - 1}"


@contextlib.contextmanager
def lattice(
    model: Path, num_workers: int, logs: Path, worker_flags: tuple[str, ...] = ()
) -> Iterator[Stack]:
    started: list[Process] = []
    try:
        scheduler = spawn("scheduler", scheduler_argv(), logs, SCHEDULER_LISTENING)
        started.append(scheduler)
        target = f"{LOOPBACK}:{scheduler.ports[0]}"
        for i in range(num_workers):
            steps = step_log_path(logs, i)
            steps.unlink(missing_ok=True)
            argv = worker_argv(
                target, f"vllm-{i + 1}", model, "--engine", "vllm",
                "--kv-cache-gib", "1", "--max-model-len", str(MAX_MODEL_LEN),
                "--max-num-batched-tokens", str(STEP_TOKENS), "--step-log", str(steps),
                *worker_flags, python=VLLM_PYTHON,
            )  # fmt: skip
            env = clean_env(VLLM_CPU_OMP_THREADS_BIND=_cores(i, num_workers))
            started.append(Process(f"vllm-{i + 1}", argv, logs / f"vllm-{i + 1}.log", env=env))
        gateway = spawn("gateway", gateway_argv(target, model), logs, GATEWAY_LISTENING)
        started.append(gateway)
        wait_until(
            lambda: _registered(scheduler.ports[1]) >= num_workers,
            f"{num_workers} vLLM workers to register",
            START_SECONDS,
            every_seconds=1.0,
            gone=lambda: next((p.log_text()[-2000:] for p in started if not p.alive()), None),
        )
        metrics_port = scheduler.ports[1]
        yield Stack(
            f"http://{LOOPBACK}:{gateway.ports[0]}",
            {p.name: p.popen.pid for p in started},
            lambda: _lattice_steps(metrics_port),
        )
    finally:
        for p in reversed(started):
            p.stop(30)


def step_log_path(logs: Path, index: int) -> Path:
    """Where Lattice worker `index` (from 0) writes its decisions and steps."""
    return logs / f"vllm-{index + 1}.steps.jsonl"


def _lattice_steps(metrics_port: int) -> tuple[float, float, float]:
    """Decisions with work and their tokens, from the scheduler's metrics."""
    from bench.harness.processes import scrape

    samples = scrape(metrics_port)
    name = "lattice_scheduler_decision_batched_tokens"
    computed = samples.get(("lattice_scheduler_prefill_tokens_total", (("source", "computed"),)))
    return (
        samples.get((f"{name}_count", ()), 0.0),
        samples.get((f"{name}_sum", ()), 0.0),
        computed or 0.0,
    )


def _plain_steps(ports: list[int]) -> tuple[float, float, float]:
    """Engine steps and their tokens, from each vLLM server's metrics."""
    totals = dict.fromkeys(
        (
            "vllm:iteration_tokens_total_count",
            "vllm:iteration_tokens_total_sum",
            "vllm:prompt_tokens_total",
            "vllm:prompt_tokens_cached_total",
        ),
        0.0,
    )
    for port in ports:
        with urllib.request.urlopen(f"http://{LOOPBACK}:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in totals:
                totals[name] += float(line.rsplit(" ", 1)[1])
    steps, tokens, prompt, cached = totals.values()
    return steps, tokens, prompt - cached


def _registered(metrics_port: int) -> int:
    from bench.harness.processes import scrape

    samples = scrape(metrics_port)
    return sum(
        1 for (name, _), _ in samples.items() if name == "lattice_scheduler_worker_kv_free_pages"
    )


@contextlib.contextmanager
def plain(model: Path, num_servers: int, rule: str, logs: Path, eager: bool) -> Iterator[Stack]:
    """`num_servers` plain vllm serve, behind a `rule` router when more than one; `eager`:
    no CUDA graphs (CPU)."""
    started: list[Process] = []
    router = None
    try:
        ports = []
        for i in range(num_servers):
            port = free_port()
            ports.append(port)
            argv = [
                str(VLLM_PYTHON), "-m", "worker_client.engine_vllm.serve", str(model),
                "--host", LOOPBACK, "--port", str(port), "--dtype", "bfloat16",
                *(["--enforce-eager"] if eager else []), "--enable-prefix-caching",
                "--seed", "0",
                "--kv-cache-memory-bytes", str(2**30), "--max-model-len", str(MAX_MODEL_LEN),
                "--max-num-batched-tokens", str(STEP_TOKENS),
                "--served-model-name", model.name,
            ]  # fmt: skip
            env = clean_env(VLLM_CPU_OMP_THREADS_BIND=_cores(i, num_servers))
            started.append(Process(f"vllm-serve-{i + 1}", argv, logs / f"serve-{i}.log", env=env))
        for port, proc in zip(ports, started):
            wait_until(
                lambda port=port: _healthy(port),
                "vllm serve to answer /health",
                START_SECONDS,
                every_seconds=1.0,
                gone=lambda proc=proc: None if proc.alive() else proc.log_text()[-2000:],
            )
        pids = {p.name: p.popen.pid for p in started}
        if num_servers == 1:
            yield Stack(f"http://{LOOPBACK}:{ports[0]}", pids, lambda: _plain_steps(ports))
            return
        router = serve(Router(ports, rule))
        url = f"http://{LOOPBACK}:{router.server_address[1]}"
        yield Stack(url, pids, lambda: _plain_steps(ports))
    finally:
        if router is not None:
            router.shutdown()
        for p in reversed(started):
            p.stop(30)


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{LOOPBACK}:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _load_line() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} CPUs"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=MODEL, help="a checkpoint directory")
    parser.add_argument("--quick", action="store_true", help="smaller loads (a smoke run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cuda: plain vllm serve with CUDA graphs, as the workers run there",
    )
    parser.add_argument(
        "--groups",
        type=int,
        default=12,
        help="decisions: groups of conversations sharing a system prompt (2 to 4 a group)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="decisions: run the three stacks this many times, interleaved (the order "
        "rotated each round); the figures compared are each stack's medians",
    )
    parser.add_argument(
        "--only", default="all", choices=("all", "overhead", "decisions"), help="one row"
    )
    parser.add_argument(
        "--lattice-only",
        action="store_true",
        help="decisions: only the Lattice stack (to profile it; no comparison printed)",
    )
    parser.add_argument(
        "--no-overlap",
        action="store_true",
        help="decisions: Lattice workers report after each step, not during it",
    )
    args = parser.parse_args(argv)
    eager = args.device == "cpu"
    if not VLLM_PYTHON.exists():
        print("bench.vllm: .venv-vllm is missing: run scripts/setup.sh --engine vllm")
        return 2
    if not (args.model / "config.json").is_file():
        from worker_client.demo_model import write_demo_checkpoint

        write_demo_checkpoint(args.model, seed=0, wide=True)
    scale = 1 if args.quick else 2
    saturation = independent(16 * scale, args.seed)
    fixed = independent(6 * scale, args.seed + 1)
    conversations = shared_prefix(args.groups, 2 * scale, 3, args.seed + 2)
    name = args.model.name
    logs = ROOT / ".artifacts" / "bench-vllm"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"bench.vllm: {args.model} ({_load_line()})", flush=True)
    results: dict[str, dict[str, Load]] = {}
    if args.only in ("all", "overhead"):
        for label, stack in (
            ("plain vllm serve", lambda: plain(args.model, 1, "round-robin", logs, eager)),
            ("lattice, 1 vLLM worker", lambda: lattice(args.model, 1, logs)),
        ):
            with stack() as s:
                run_conversations(s.url, name, independent(2, 99), 2, 4)  # warm up
                results[label] = {
                    "saturation": measured(
                        s, lambda s=s: run_conversations(s.url, name, saturation, 16, 32)
                    ),
                    "fixed": run_conversations(s.url, name, fixed, 1, 32),
                }
            print(f"  {label}: done ({_load_line()})", flush=True)
        print_overhead(results, len(saturation), len(fixed))
        print_costs(results, "saturation", ("lattice, 1 vLLM worker", "plain vllm serve"))
    if args.only in ("all", "decisions"):
        stacks = {
            "2 vllm serve, round-robin": lambda logs: plain(
                args.model, 2, "round-robin", logs, eager
            ),
            "2 vllm serve, prefix-load": lambda logs: plain(
                args.model, 2, "prefix-load", logs, eager
            ),
            "lattice, 2 vLLM workers": lambda logs: lattice(
                args.model, 2, logs, ("--no-overlap",) if args.no_overlap else ()
            ),
        }
        labels = [LATTICE] if args.lattice_only else list(stacks)
        rounds = []
        for index in range(args.rounds):
            # One round's logs apart, so that bench.harness.waits reads each.
            round_logs = logs if args.rounds == 1 else logs / f"round-{index + 1}"
            round_logs.mkdir(parents=True, exist_ok=True)
            by_stack = {}
            for label in round_order(labels, index):
                by_stack[label] = run_decisions(
                    stacks[label],
                    round_logs,
                    name,
                    lambda url: run_conversations(url, name, conversations, 8, 24),
                )
                print(f"  round {index + 1}, {label}: done ({_load_line()})", flush=True)
            rounds.append(by_stack)
            write_requests(by_stack, round_logs / "requests.json")
            if args.rounds > 1:
                print_round(index + 1, by_stack, round_logs)
        results.update({label: {"conversations": load} for label, load in rounds[-1].items()})
        print_decisions(rounds, len(conversations))
        if args.rounds == 1:
            print_costs(results, "conversations", DECISION_ROWS)
            print_worker_lines(logs, 2)
            if LATTICE in results:
                print_burst(results[LATTICE]["conversations"], logs, 2)
    return 0


def write_requests(by_stack: dict[str, Load], path: Path) -> None:
    """Every request of one round of the decisions row by stack, with its load's start (for
    bench/harness/waits.py, beside the Lattice workers' step logs)."""
    rows = {
        label: {"started_at": load.started_at, "requests": [asdict(r) for r in load.requests]}
        for label, load in by_stack.items()
    }
    path.write_text(json.dumps(rows))
    print(f"  requests: {path}")


def run_decisions(
    stack: Callable[[Path], contextlib.AbstractContextManager[Stack]],
    logs: Path,
    name: str,
    run: Callable[[str], Load],
) -> Load:
    """One stack of the decisions row: started, warmed up, measured over `run`, stopped;
    then every process it started (children included) is checked to have ended."""
    with stack(logs) as s:
        run_conversations(s.url, name, independent(2, 98), 2, 4)  # warm up
        load_before = os.getloadavg()[0]
        load = measured(s, lambda: run(s.url))
        started = {pid: start for root in s.pids.values() for pid, start in process_tree(root)}
    load.load_average = (load_before, os.getloadavg()[0])
    left = _left_running(started, ENDED_SECONDS)
    if left:
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        names = ", ".join(f"{pid} {name}" for pid, name in left.items())
        print(f"  still running {ENDED_SECONDS:.0f} s after the stack stopped, killed: {names}")
    return load


def print_overhead(results: dict[str, dict[str, Load]], num_sat: int, num_fixed: int) -> None:
    print()
    print(
        f"overhead: {num_sat} requests x 32 tokens at concurrency 16 (saturation); "
        f"{num_fixed} at concurrency 1 (fixed load)"
    )
    print("| server | output tok/s (saturation) | TTFT p50 / p99 ms | TPOT p50 / p99 ms | errors |")
    print("| --- | --- | --- | --- | --- |")
    for label in ("lattice, 1 vLLM worker", "plain vllm serve"):
        sat, fixed = results[label]["saturation"], results[label]["fixed"]
        errors = len(sat.requests) - len(sat.ok) + len(fixed.requests) - len(fixed.ok)
        print(
            f"| {label} | {sat.tokens_per_second:.1f} | {fixed.ttft(0.5) * 1000:.0f} / "
            f"{fixed.ttft(0.99) * 1000:.0f} | {fixed.tpot(0.5) * 1000:.1f} / "
            f"{fixed.tpot(0.99) * 1000:.1f} | {errors} |"
        )
    sys.stdout.flush()


LATTICE = "lattice, 2 vLLM workers"
DECISION_ROWS = (
    LATTICE,
    "2 vllm serve, round-robin",
    "2 vllm serve, prefix-load",
)


def print_costs(results: dict[str, dict[str, Load]], load_name: str, labels) -> None:
    """Where the time went: CPU seconds by process over the load's wall time, the steps
    the engines ran and their tokens."""
    print()
    print(f"where the time went ({load_name}): CPU s by process (children included)")
    print(
        "| servers | wall s | CPU s by process | CPU s in all | output tokens per CPU s | "
        "steps | tokens a step | prompt tokens computed |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for label in labels:
        if label not in results:
            continue
        load = results[label][load_name]
        by_role = ", ".join(f"{role} {sec:.1f}" for role, sec in load.cpu_seconds.items())
        per_step = load.num_step_tokens / load.num_steps if load.num_steps else float("nan")
        cpu = sum(load.cpu_seconds.values())
        tokens = sum(r.tokens for r in load.ok)
        print(
            f"| {label} | {load.wall:.1f} | {by_role} | {cpu:.1f} | {tokens / cpu:.0f} | "
            f"{load.num_steps:.0f} | {per_step:.1f} | {load.num_computed_prompt_tokens:.0f} |"
        )
    sys.stdout.flush()


def print_worker_lines(logs: Path, num_workers: int) -> None:
    """What each Lattice vLLM worker said it ran when it left (warm-up included)."""
    for i in range(num_workers):
        path = logs / f"vllm-{i + 1}.log"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        for line in lines:
            if "vLLM steps" in line:
                print(f"  {line}")
    sys.stdout.flush()


def print_burst(load: Load, logs: Path, num_workers: int) -> None:
    """Where the Lattice stack's opening burst and its slowest first tokens spent their
    time, from the workers' step logs."""
    from bench.harness.timeline import Timeline, burst_lines, slowest_lines

    timeline = Timeline.read(step_log_path(logs, i) for i in range(num_workers))
    for lines in (
        burst_lines(load.requests, load.started_at, timeline),
        slowest_lines(load.requests, load.started_at, timeline),
    ):
        if lines:
            print()
            print("\n".join(lines))
    sys.stdout.flush()


def print_decisions(rounds: list[dict[str, Load]], num_conv: int) -> None:
    """Every round's row, then each stack's medians over the rounds and the targets' ratios
    computed from them (with one round: its figures)."""
    print()
    print(
        f"decisions: {num_conv} conversations x 3 turns, 2 to 4 a group, each group sharing a "
        f"system prompt, 24 tokens a turn, concurrency 8; {len(rounds)} round(s), the stacks' "
        "order rotated each round; medians over the rounds, ratios from the medians"
    )
    print(
        "| round | servers | load average, start / end | output tok/s | TTFT p50 / p99 ms | errors |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for index, by_stack in enumerate(rounds, 1):
        for label in DECISION_ROWS:
            if label in by_stack:
                print(_decisions_row(str(index), label, by_stack[label]))
    medians = stack_medians(rounds)
    for label, m in medians.items():
        print(
            f"| median | {label} | | {m.tokens_per_second:.1f} | {m.ttft_p50 * 1000:.0f} / "
            f"{m.ttft_p99 * 1000:.0f} | {m.num_errors} |"
        )
    ratios = target_ratios(medians)
    if ratios is not None:
        print(
            f"Lattice against the best alternative, from the medians: throughput "
            f"{ratios[0]:.2f}x (target >= 1.0x), TTFT p99 {ratios[1]:.2f}x (target <= 0.8x)"
        )
    print()
    print("slowest first tokens: TTFT ms (turn, seconds into the load when sent)")
    for index, by_stack in enumerate(rounds, 1):
        for label in DECISION_ROWS:
            if label in by_stack:
                slowest = sorted(by_stack[label].ok, key=lambda r: -r.ttft)[:4]
                cells = ", ".join(
                    f"{r.ttft * 1000:.0f} ({r.turn}, {r.sent:.1f} s)" for r in slowest
                )
                print(f"  {f'round {index}, ' if len(rounds) > 1 else ''}{label}: {cells}")
    sys.stdout.flush()


@dataclass(frozen=True)
class Medians:
    """One stack's medians over the rounds (each figure's own median)."""

    tokens_per_second: float
    ttft_p50: float
    ttft_p99: float
    num_errors: int  # over all rounds


def round_order(labels: list[str], index: int) -> list[str]:
    """The stacks of round `index` (from 0) in the order they run: `labels` rotated by
    `index`, so that over len(labels) rounds each stack runs once first and once last."""
    shift = index % len(labels)
    return labels[shift:] + labels[:shift]


def stack_medians(rounds: list[dict[str, Load]]) -> dict[str, Medians]:
    """Each stack's medians over the rounds it ran in (DECISION_ROWS' order)."""
    medians = {}
    for label in DECISION_ROWS:
        loads = [by_stack[label] for by_stack in rounds if label in by_stack]
        if loads:
            medians[label] = Medians(
                statistics.median(load.tokens_per_second for load in loads),
                statistics.median(load.ttft(0.5) for load in loads),
                statistics.median(load.ttft(0.99) for load in loads),
                sum(len(load.requests) - len(load.ok) for load in loads),
            )
    return medians


def target_ratios(medians: dict[str, Medians]) -> tuple[float, float] | None:
    """Lattice's median throughput over the best router's, and its median TTFT p99 over the
    best alternative's (the targets: >= 1.0x, <= 0.8x); None without Lattice and a router."""
    routers = [m for label, m in medians.items() if label != LATTICE]
    if LATTICE not in medians or not routers:
        return None
    ours = medians[LATTICE]
    return (
        ours.tokens_per_second / max(m.tokens_per_second for m in routers),
        ours.ttft_p99 / min(m.ttft_p99 for m in routers),
    )


def _decisions_row(round_name: str, label: str, load: Load) -> str:
    start, end = load.load_average
    return (
        f"| {round_name} | {label} | {start:.2f} / {end:.2f} | {load.tokens_per_second:.1f} | "
        f"{load.ttft(0.5) * 1000:.0f} / {load.ttft(0.99) * 1000:.0f} | "
        f"{len(load.requests) - len(load.ok)} |"
    )


def print_round(index: int, by_stack: dict[str, Load], logs: Path) -> None:
    """One round's rows as soon as it ends, and where the Lattice stack's requests waited
    before their first step (bench/harness/waits.py reads `logs` for the details)."""
    from bench.harness.waits import summary

    print()
    for label in DECISION_ROWS:
        if label in by_stack:
            print(_decisions_row(str(index), label, by_stack[label]))
    if LATTICE in by_stack:
        print(f"  lattice, round {index}: {summary(logs)} (bench.harness.waits {logs})")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
