"""What the engine benchmarks (bench/prefill.py, bench/worker.py) share:
their workload arguments, seeded prompts, an engine sized so that nothing is preempted,
the engine driven directly as a worker would drive it, and an in-process scheduler with a
WorkerLoop thread on the engine."""

from __future__ import annotations

import argparse
import math
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import grpc
import torch
from prometheus_client import CollectorRegistry

from lattice.scheduler.v1 import scheduler_pb2 as pb
from lattice.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from service.core import SchedulerConfig
from service.server.app import start
from service.settings import ServeSettings
from worker_client.client import SchedulerClient, WorkerResources
from worker_client.engine.api import SequenceSpec, StepOutput
from worker_client.engine.engine import ModelEngine
from worker_client.engine.model import Qwen35ForCausalLM
from worker_client.loop import WorkerLoop
from worker_client.profiling import next_prefill_chunks

PAGE_SIZE = 16
# Prompts use ids from 2 up (0 pads a static batch) and below this bound, so that a real
# checkpoint's vocabulary tail (special tokens) stays out of them.
MAX_PROMPT_TOKEN_ID = 50_000
Tokens = tuple[int, ...]


def add_workload_arguments(
    parser: argparse.ArgumentParser,
    presets: Iterable[str],
    *,
    num_prompts: int,
    min_prompt_len: int,
    max_prompt_len: int,
    max_new_tokens: int,
) -> None:
    """The flags both benchmarks take: model, device, workload, repeats, threads, seed."""
    parser.add_argument(
        "--preset",
        choices=sorted(presets),
        default="tiny",
        help="random-weight model to build (ignored with --model)",
    )
    parser.add_argument("--model", type=Path, help="a checkpoint directory instead of a preset")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--min-prompt-len", type=int, default=min_prompt_len)
    parser.add_argument("--max-prompt-len", type=int, default=max_prompt_len)
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=128,
        help="prefill chunk (tokens) of each prompt per step, as the scheduler's chunk_size",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per mode; the fastest counts"
    )
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the random weights and prompts")
    parser.add_argument(
        "--no-scheduler",
        action="store_true",
        help="skip the scheduler rows (gRPC scheduler and worker loop in-process)",
    )


def check_workload_arguments(
    parser: argparse.ArgumentParser, args: argparse.Namespace, min_num_prompts: int = 1
) -> None:
    """parser.error (one line, naming the flags) on a workload that cannot run."""
    if args.num_prompts < min_num_prompts:
        parser.error(f"--num-prompts must be at least {min_num_prompts}")
    if min(args.max_new_tokens, args.repeats, args.chunk_size) < 1:
        parser.error("--max-new-tokens, --repeats and --chunk-size must be at least 1")
    if not 1 <= args.min_prompt_len <= args.max_prompt_len:
        parser.error("need 1 <= --min-prompt-len <= --max-prompt-len")


def configure_torch(args: argparse.Namespace) -> None:
    """--threads, and torch's warnings off (a benchmark's table is its output)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")


def random_prompts(
    num_prompts: int, min_len: int, max_len: int, vocab_size: int, seed: int
) -> list[Tokens]:
    """Seeded prompts of lengths in [min_len, max_len], ids in [2, MAX_PROMPT_TOKEN_ID)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num_prompts,), generator=generator).tolist()
    high = min(vocab_size, MAX_PROMPT_TOKEN_ID)
    return [tuple(torch.randint(2, high, (n,), generator=generator).tolist()) for n in lengths]


def make_engine(
    model: Qwen35ForCausalLM,
    prompts: Sequence[Tokens],
    max_new_tokens: int,
    *,
    max_prefill_sequences: int | None = None,
) -> ModelEngine:
    """A slot for every prompt and pages for all of them at full length: nothing is
    preempted. `max_prefill_sequences`: the engine's (None: every chunk of a step in one
    forward)."""
    num_pages = sum(math.ceil((len(p) + max_new_tokens) / PAGE_SIZE) + 1 for p in prompts)
    return ModelEngine(
        model,
        total_kv_pages=num_pages,
        page_size=PAGE_SIZE,
        total_gdn_slots=len(prompts),
        device=model.device,
        max_batch_size=len(prompts),
        max_prefill_sequences=max_prefill_sequences,
    )


def run_directly(
    engine: ModelEngine,
    prompts: Sequence[Tokens],
    max_new_tokens: int,
    chunk_size: int,
    after_step: Callable[[StepOutput], None] | None = None,
) -> list[Tokens]:
    """ModelEngine.step driven as a worker drives it: every prompt admitted at once, each
    step the next `chunk_size` chunk of every prompt not yet prefilled plus one decode of
    every running sequence, until all finish. `after_step(output)` after each step. The
    generated tokens of each prompt, in prompt order; SystemExit if the engine preempts."""
    specs = [SequenceSpec(prompt_token_ids=p, max_new_tokens=max_new_tokens) for p in prompts]
    num_scheduled = [0] * len(prompts)  # prompt tokens handed to the engine so far
    generated: list[list[int]] = [[] for _ in prompts]
    num_finished = 0
    while num_finished < len(prompts):
        prefill = next_prefill_chunks(specs, num_scheduled, chunk_size)
        out = engine.step(prefill, engine.running_ids())
        if out.preempted:
            raise SystemExit(f"engine preempted {out.preempted}: the pools are sized too small")
        if after_step is not None:
            after_step(out)
        for seq_id, token_ids in out.tokens:
            generated[seq_id].extend(token_ids)
        num_finished += len(out.finished)
    return [tuple(tokens) for tokens in generated]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU), before reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SchedulerStack:
    """A scheduler on a loopback port and one WorkerLoop thread on `engine`.

    `session`, `overlap`: the worker's (lattice-worker's defaults: both on). The lease is
    long: one step of a larger model on a busy CPU can outlast the default 10 s. The worker
    registers the engine's prefix cache (if it keeps one); `config` overrides the
    scheduler's settings (e.g. prefix_caching="off", policy="budget"). `registry` holds
    the scheduler's metrics (read them with `metric`).
    """

    def __init__(
        self,
        engine: ModelEngine,
        chunk_size: int,
        *,
        session: bool = True,
        overlap: bool = True,
        lease_ttl_ms: int = 600_000,
        **config,
    ) -> None:
        config = SchedulerConfig(
            **{
                "max_batch_size": engine.max_batch_size,
                "chunk_size": chunk_size,
                "lease_ttl_ms": lease_ttl_ms,
                **config,
            }
        )
        self.registry = CollectorRegistry()
        self._server = start(
            ServeSettings(host="127.0.0.1", port=0, metrics_port=0, scheduler=config), self.registry
        )
        target = f"127.0.0.1:{self._server.port}"
        self._client = SchedulerClient(target, session=session)
        resources = WorkerResources.of("bench", engine, engine.max_batch_size)
        self._loop = WorkerLoop(
            engine, self._client, resources, idle_sleep_seconds=0.001, overlap=overlap
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop.run, args=(self._stop,), daemon=True)
        self._thread.start()
        self._channel = grpc.insecure_channel(target)
        self._stub = pb_grpc.SchedulerStub(self._channel)
        self.last_seq_id = 0  # the seq_id of the latest generate's stream

    def generate(
        self, prompt: Tokens, max_new_tokens: int, started: float | None = None
    ) -> tuple[Tokens, float]:
        """One Generate stream: its tokens, and the seconds from `started` (a perf_counter
        reading; default: the call) to its first token (nan if none came)."""
        started = time.perf_counter() if started is None else started
        request = pb.SubmitRequest(prompt_token_ids=prompt, max_new_tokens=max_new_tokens)
        tokens: list[int] = []
        first_token_seconds = math.nan
        for event in self._stub.Generate(request, timeout=600):
            self.last_seq_id = event.seq_id
            if event.token_ids and not tokens:
                first_token_seconds = time.perf_counter() - started
            tokens.extend(event.token_ids)
        return tuple(tokens), first_token_seconds

    def get_sequence(self, seq_id: int) -> pb.SequenceInfo:
        return self._stub.GetSequence(pb.GetSequenceRequest(seq_id=seq_id), timeout=30)

    def metric(self, name: str, **labels: str) -> float:
        """A scheduler metric's value now (0 if it has no sample yet)."""
        return self.registry.get_sample_value(name, labels or None) or 0.0

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._channel.close()
        self._client.close()
        self._server.stop(0)
