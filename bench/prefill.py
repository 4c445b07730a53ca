#!/usr/bin/env python3
"""Batched prefill: one forward per prompt chunk (before) next to chunks of many sequences
packed into one forward (after), on the same engine, weights and prompts.

    .venv/bin/python -m bench.prefill                       # tiny dense model, CPU fp32
    .venv/bin/python -m bench.prefill --preset tiny-next    # tiny Qwen3-Next (MoE)
    .venv/bin/python -m bench.prefill --preset small-moe    # 8 layers, 32 experts, top-4
    .venv/bin/python -m bench.prefill --device cuda --dtype bfloat16 --model DIR

Workload: --num-prompts (16) prompts of mixed lengths (seeded, --min-prompt-len to
--max-prompt-len), greedy, --max-new-tokens each with EOS ignored. "before" is the
engine with max_prefill_sequences=1 (one forward per chunk, as the engine ran
before batched prefill); "after" is the default (every sequence's chunk of a step
in one forward). Two drivers:

  direct     ModelEngine.step as a worker drives it: all prompts admitted at
             once, each step the next --chunk-size chunk of every prompt not yet
             prefilled plus one decode of every running sequence.
  scheduler  the real scheduler on loopback, a WorkerLoop thread on the engine, and
             --num-prompts concurrent Generate streams (skip: --no-scheduler).

Columns: prefill s (until every prompt has its first token), mean TTFT, total s,
cpu s (this process's CPU time: steadier than wall time on a busy host), generated
tokens/s, and the prefill forwards run. On a loaded CPU host pass
--threads 1: two torch threads waiting on each other's busy core cost far more
than they save. Each figure is the
best of --repeats runs after a warm-up (on a shared host others only add time).
The script exits non-zero unless before and after generate identical tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from bench.harness.engine_bench import (
    SchedulerStack,
    Tokens,
    add_workload_arguments,
    check_workload_arguments,
    configure_torch,
    make_engine,
    random_prompts,
    run_directly,
    synchronize,
)
from bench.harness.tables import print_table
from worker_client.engine.config import ModelConfig, MoeConfig, small_config
from worker_client.engine.loading import PRESETS, load_model, random_model
from worker_client.engine.model import Qwen35ForCausalLM


def small_moe_config() -> ModelConfig:
    """small_config() with a Qwen3.5 MoE block in every layer: 32 experts of 256, top-4, shared 512."""
    moe = MoeConfig(
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=512,
    )
    return dataclasses.replace(small_config(), intermediate_size=0, moe=moe)


MODELS: dict[str, Callable[[], ModelConfig]] = {
    **PRESETS,
    "small": small_config,
    "small-moe": small_moe_config,
}


@dataclass(frozen=True)
class Run:
    """One timed run of a mode."""

    outputs: tuple[Tokens, ...]
    prefill_seconds: float  # until every prompt had its first token
    mean_ttft_seconds: float
    total_seconds: float
    cpu_seconds: (
        float  # this process's CPU time over the run: steadier than wall time on a busy host
    )
    num_prefill_forwards: int

    @property
    def tokens_per_second(self) -> float:
        return sum(len(t) for t in self.outputs) / self.total_seconds


class ForwardCounter:
    """Within `with`: counts the model's packed forwards with a row of more than one token (prefill)."""

    def __init__(self, model: Qwen35ForCausalLM) -> None:
        self.count = 0
        self._model = model
        self._original = model.forward_packed

    def __enter__(self) -> ForwardCounter:
        self._model.forward_packed = self._counted  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc_info) -> None:
        del self._model.forward_packed  # back to the class's method

    def _counted(self, token_ids, batch, *args, **kwargs):
        if batch.num_tokens > batch.num_rows:
            self.count += 1
        return self._original(token_ids, batch, *args, **kwargs)


def run_direct(
    model: Qwen35ForCausalLM,
    prompts: Sequence[Tokens],
    max_new_tokens: int,
    chunk_size: int,
    packed: bool,
) -> Run:
    engine = make_engine(
        model, prompts, max_new_tokens, max_prefill_sequences=None if packed else 1
    )
    first_token_at: dict[int, float] = {}

    def record_first_tokens(out) -> None:
        synchronize(model.device)
        now = time.perf_counter()
        for seq_id, _ in out.tokens:
            first_token_at.setdefault(seq_id, now)

    started, cpu_started = time.perf_counter(), time.process_time()
    with ForwardCounter(model) as counter:
        outputs = run_directly(
            engine, prompts, max_new_tokens, chunk_size, after_step=record_first_tokens
        )
    ttfts = [t - started for t in first_token_at.values()]
    return Run(
        tuple(outputs),
        max(ttfts),
        sum(ttfts) / len(ttfts),
        time.perf_counter() - started,
        time.process_time() - cpu_started,
        counter.count,
    )


def run_scheduler(
    model: Qwen35ForCausalLM, stack: SchedulerStack, prompts: Sequence[Tokens], max_new_tokens: int
) -> Run:
    started, cpu_started = time.perf_counter(), time.process_time()
    with ForwardCounter(model) as counter, ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        results = list(pool.map(lambda p: stack.generate(p, max_new_tokens, started), prompts))
    total, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    ttfts = [ttft for _, ttft in results]
    return Run(
        tuple(tokens for tokens, _ in results),
        max(ttfts),
        sum(ttfts) / len(ttfts),
        total,
        cpu,
        counter.count,
    )


def best_of(repeats: int, run: Callable[[], Run], warm_up: Callable[[], Run]) -> Run:
    """The fastest of `repeats` runs after a warm-up; all must generate the same tokens."""
    warm_up()
    runs = [run() for _ in range(repeats)]
    if any(r.outputs != runs[0].outputs for r in runs):
        raise SystemExit("two runs of the same greedy workload generated different tokens")
    return min(runs, key=lambda r: r.total_seconds)


def print_runs(rows: Sequence[tuple[str, Run, Run]]) -> None:
    print_table(
        ["driver", "", "prefill s", "mean TTFT s", "total s", "cpu s", "tokens/s", "prefill fwds"],
        [
            [
                driver,
                label,
                f"{run.prefill_seconds:.3f}",
                f"{run.mean_ttft_seconds:.3f}",
                f"{run.total_seconds:.3f}",
                f"{run.cpu_seconds:.3f}",
                f"{run.tokens_per_second:.1f}",
                run.num_prefill_forwards,
            ]
            for driver, before, after in rows
            for label, run in (("before", before), ("after", after))
        ],
    )
    for driver, before, after in rows:
        print(
            f"{driver:<10} after vs before: prefill {before.prefill_seconds / after.prefill_seconds:.2f}x "
            f"as fast, tokens/s {after.tokens_per_second / before.tokens_per_second:.2f}x, "
            f"cpu {after.cpu_seconds / before.cpu_seconds:.2f}x"
        )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.prefill",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_workload_arguments(
        parser, MODELS, num_prompts=16, min_prompt_len=16, max_prompt_len=512, max_new_tokens=16
    )
    args = parser.parse_args(argv)
    check_workload_arguments(parser, args)
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    configure_torch(args)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.model is not None:
        model = load_model(args.model, device=device, dtype=dtype)
    else:
        model = random_model(MODELS[args.preset](), args.seed).to(device=device, dtype=dtype).eval()
    model.config = dataclasses.replace(
        model.config, eos_token_ids=()
    )  # every prompt runs to the limit
    prompts = random_prompts(
        args.num_prompts,
        args.min_prompt_len,
        args.max_prompt_len,
        model.config.vocab_size,
        args.seed,
    )
    lengths = sorted(len(p) for p in prompts)
    num_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {args.model or args.preset} ({num_params / 1e6:.1f}M params, {model.config.num_hidden_layers} "
        f"layers, {'MoE' if model.config.moe else 'dense'}), {device} {args.dtype}, "
        f"{torch.get_num_threads()} torch threads"
    )
    print(
        f"workload: {len(prompts)} prompts of {lengths[0]}-{lengths[-1]} tokens ({sum(lengths)} in all), "
        f"greedy, {args.max_new_tokens} new tokens each, chunk size {args.chunk_size}, best of {args.repeats}"
    )
    n, warm = args.max_new_tokens, prompts[:2]
    rows = []
    direct = [
        best_of(
            args.repeats,
            lambda packed=packed: run_direct(model, prompts, n, args.chunk_size, packed),
            lambda packed=packed: run_direct(model, warm, 2, args.chunk_size, packed),
        )
        for packed in (False, True)
    ]
    rows.append(("direct", *direct))
    if not args.no_scheduler:
        via_scheduler = []
        for packed in (False, True):
            engine = make_engine(model, prompts, n, max_prefill_sequences=None if packed else 1)
            stack = SchedulerStack(engine, args.chunk_size)
            try:
                via_scheduler.append(
                    best_of(
                        args.repeats,
                        lambda stack=stack: run_scheduler(model, stack, prompts, n),
                        lambda stack=stack: run_scheduler(model, stack, warm, 2),
                    )
                )
            finally:
                stack.close()
        rows.append(("scheduler", *via_scheduler))
    print()
    print_runs(rows)
    print()
    runs = [run for _, before, after in rows for run in (before, after)]
    if any(run.outputs != runs[0].outputs for run in runs):
        raise SystemExit("greedy tokens differ between before and after")
    print(f"greedy tokens: identical in every row ({len(prompts)} prompts x {n} tokens)")


if __name__ == "__main__":
    main()
