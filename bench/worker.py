#!/usr/bin/env python3
"""Generation throughput of the reference worker engine next to transformers' `generate`.

Both sides load the very same checkpoint: for the `tiny` and `small` presets a
seeded random model is written once with transformers' `save_pretrained` into a
temporary directory; `--model DIR` uses a real Qwen3.5 checkpoint instead. Every
prompt is random token ids, decoding is greedy and EOS is ignored on both sides,
so every sequence generates exactly --max-new-tokens tokens.

    python -m bench.worker                      # tiny model, fp32 on CPU
    python -m bench.worker --preset small       # 8 layers, hidden 512
    python -m bench.worker --device cuda --dtype bfloat16 --model DIR \\
        --num-prompts 64 --max-new-tokens 256           # on a GPU, a real checkpoint

Rows (each timed after a short warm-up run of the same mode; the best of --repeats):
  hf one-at-a-time   transformers generate, one prompt after another
  hf static batch    transformers generate on all prompts, left-padded, with attention mask
  engine direct      ModelEngine.step driven as a worker would: every sequence admitted
                     at once, prompts prefilled --chunk-size tokens per step, then batched
                     decode steps until all finish (continuous batching, no gRPC)
  sched in turn      the real scheduler on loopback, a WorkerLoop thread on the same
                     engine and one Generate stream per prompt; the worker as before
                     sessions and overlap: a unary SelectBatch, then the step, in turn
                     (lattice-worker --no-session --no-overlap)
  sched overlap      the same with lattice-worker's defaults: a WorkerSession stream, and
                     the next report answered while the engine steps (skip both
                     scheduler rows: --no-scheduler)

Tokens/s counts generated tokens over the whole run, prefill included. The greedy
tokens of every row are compared with `hf one-at-a-time` (fp32 should agree token
for token; bf16 may drift after a near tie).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

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
from worker_client.engine.config import ModelConfig
from worker_client.engine.loading import PRESETS, load_model, random_model
from worker_client.engine.model import Qwen35ForCausalLM

# The dense presets (transformers' Qwen3_5ForCausalLM is the reference here).
DENSE_PRESETS = ("tiny", "small")
PAD_TOKEN_ID = 0  # pads the static batch; random_prompts' ids start at 2
NUM_WARMUP_PROMPTS = 2
NUM_WARMUP_TOKENS = 4


@dataclass(frozen=True)
class Result:
    """One timed mode: what it generated per prompt and how long it took."""

    mode: str
    outputs: tuple[Tokens, ...]
    seconds: float

    @property
    def num_tokens(self) -> int:
        return sum(len(tokens) for tokens in self.outputs)

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds


@dataclass(frozen=True)
class Models:
    """Our model and transformers' model, both loaded from the same checkpoint, EOS off."""

    ours: Qwen35ForCausalLM
    hf: torch.nn.Module
    device: torch.device


# Models.


def hf_config(config: ModelConfig) -> transformers.Qwen3_5TextConfig:
    """transformers' config for `config`, without an EOS id (generation runs to the limit)."""
    return transformers.Qwen3_5TextConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        layer_types=[t.value for t in config.layer_types],
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": config.rope_theta,
            "partial_rotary_factor": config.partial_rotary_factor,
        },
        linear_num_key_heads=config.linear_num_key_heads,
        linear_num_value_heads=config.linear_num_value_heads,
        linear_key_head_dim=config.linear_key_head_dim,
        linear_value_head_dim=config.linear_value_head_dim,
        linear_conv_kernel_dim=config.linear_conv_kernel_dim,
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        max_position_embeddings=config.max_position_embeddings,
        eos_token_id=None,
    )


def write_random_checkpoint(config: ModelConfig, seed: int, model_dir: Path) -> None:
    """Save the seeded random weights of `config` with transformers' save_pretrained."""
    hf_model = transformers.Qwen3_5ForCausalLM(hf_config(config))
    # Our random init perturbs every norm and gate, unlike transformers' identity init.
    hf_model.load_state_dict(random_model(config, seed).state_dict(), strict=True)
    hf_model.save_pretrained(model_dir)


def load_models(model_dir: Path, device: torch.device, dtype: torch.dtype) -> Models:
    ours = load_model(model_dir, device=device, dtype=dtype)
    ours.config = dataclasses.replace(ours.config, eos_token_ids=())  # the engine reads EOS here
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    hf.generation_config.eos_token_id = None
    return Models(ours=ours, hf=hf, device=device)


# The modes: each returns the generated tokens of every prompt, in prompt order.


def hf_one_at_a_time(
    models: Models, prompts: Sequence[Tokens], max_new_tokens: int
) -> list[Tokens]:
    outputs = []
    for prompt in prompts:
        input_ids = torch.tensor([prompt], device=models.device)
        generated = models.hf.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=PAD_TOKEN_ID,
        )
        outputs.append(tuple(generated[0, len(prompt) :].tolist()))
    return outputs


def hf_static_batch(models: Models, prompts: Sequence[Tokens], max_new_tokens: int) -> list[Tokens]:
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), PAD_TOKEN_ID, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):  # left padding
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    generated = models.hf.generate(
        input_ids.to(models.device),
        attention_mask=attention_mask.to(models.device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=PAD_TOKEN_ID,
    )
    return [tuple(row) for row in generated[:, width:].tolist()]


def engine_direct(
    models: Models, prompts: Sequence[Tokens], max_new_tokens: int, chunk_size: int
) -> list[Tokens]:
    """Each step: the next chunk of every prompt not yet prefilled, one decode of all running."""
    return run_directly(
        make_engine(models.ours, prompts, max_new_tokens), prompts, max_new_tokens, chunk_size
    )


def engine_via_scheduler(
    stack: SchedulerStack, prompts: Sequence[Tokens], max_new_tokens: int
) -> list[Tokens]:
    # One Generate stream per prompt, all open at once, as concurrent clients would be.
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        return [
            tokens for tokens, _ in pool.map(lambda p: stack.generate(p, max_new_tokens), prompts)
        ]


# Timing and report.


def timed(
    mode: str,
    run: Callable[[Sequence[Tokens], int], list[Tokens]],
    prompts: Sequence[Tokens],
    max_new_tokens: int,
    device: torch.device,
    repeats: int,
) -> Result:
    """Warm up on a couple of short generations, then the fastest of `repeats` whole runs.

    The fastest, because on a shared host other processes only ever add time.
    Raises SystemExit if two runs of the same mode generate different tokens.
    """
    run(prompts[:NUM_WARMUP_PROMPTS], NUM_WARMUP_TOKENS)
    best: Result | None = None
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        outputs = tuple(run(prompts, max_new_tokens))
        synchronize(device)
        result = Result(mode, outputs, time.perf_counter() - started)
        if best is not None and best.outputs != outputs:
            raise SystemExit(
                f"{mode}: two runs of the same greedy workload generated different tokens"
            )
        if best is None or result.seconds < best.seconds:
            best = result
    return best


def print_results(results: Sequence[Result]) -> None:
    one_at_a_time, static_batch, direct = results[0], results[1], results[2]
    print_table(
        [
            "mode",
            "seqs",
            "tokens",
            "seconds",
            "tokens/s",
            "vs hf 1-by-1",
            "vs hf batch",
            "vs direct",
        ],
        [
            [
                r.mode,
                len(r.outputs),
                r.num_tokens,
                f"{r.seconds:.2f}",
                f"{r.tokens_per_second:.1f}",
                f"{r.tokens_per_second / one_at_a_time.tokens_per_second:.2f}x",
                f"{r.tokens_per_second / static_batch.tokens_per_second:.2f}x",
                f"{r.tokens_per_second / direct.tokens_per_second:.2f}x",
            ]
            for r in results
        ],
    )


def describe_agreement(result: Result, baseline: Result) -> str:
    """'identical' or which prompts differ and where, against the baseline's tokens."""
    differing = []
    for index, (ours, theirs) in enumerate(zip(result.outputs, baseline.outputs)):
        if ours != theirs:
            position = next(
                (i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                min(len(ours), len(theirs)),
            )
            differing.append(f"prompt {index} from token {position} of {len(theirs)}")
    if not differing:
        return f"identical token for token ({len(result.outputs)}/{len(result.outputs)} prompts)"
    return f"{len(differing)}/{len(result.outputs)} prompts differ: " + "; ".join(differing)


def check_lengths(results: Sequence[Result], max_new_tokens: int) -> None:
    for r in results:
        short = [i for i, tokens in enumerate(r.outputs) if len(tokens) != max_new_tokens]
        if short:
            print(
                f"WARNING: {r.mode}: prompts {short} did not generate exactly {max_new_tokens} tokens"
            )


# Entry point.


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.worker",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_workload_arguments(
        parser,
        DENSE_PRESETS,
        num_prompts=8,
        min_prompt_len=32,
        max_prompt_len=256,
        max_new_tokens=64,
    )
    args = parser.parse_args(argv)
    check_workload_arguments(parser, args, min_num_prompts=NUM_WARMUP_PROMPTS)
    return args


def run_benchmark(args: argparse.Namespace, model_dir: Path) -> list[Result]:
    device = torch.device(args.device)
    models = load_models(model_dir, device, getattr(torch, args.dtype))
    prompts = random_prompts(
        args.num_prompts,
        args.min_prompt_len,
        args.max_prompt_len,
        models.ours.config.vocab_size,
        args.seed,
    )
    lengths = sorted(len(p) for p in prompts)
    config = models.ours.config
    num_params = sum(p.numel() for p in models.ours.parameters())
    print(
        f"model: {args.model or args.preset} ({num_params / 1e6:.1f}M params, "
        f"{config.num_hidden_layers} layers, hidden {config.hidden_size}), {device} {args.dtype}, "
        f"{torch.get_num_threads()} torch threads, transformers {transformers.__version__}"
    )
    print(
        f"workload: {len(prompts)} prompts of {lengths[0]}-{lengths[-1]} tokens "
        f"({sum(lengths)} in all), greedy, {args.max_new_tokens} new tokens each, EOS ignored, "
        f"chunk size {args.chunk_size}, best of {args.repeats}"
    )
    m, n, r = models, args.max_new_tokens, args.repeats
    results = [
        timed("hf one-at-a-time", lambda p, k: hf_one_at_a_time(m, p, k), prompts, n, device, r),
        timed("hf static batch", lambda p, k: hf_static_batch(m, p, k), prompts, n, device, r),
        timed(
            "engine direct",
            lambda p, k: engine_direct(m, p, k, args.chunk_size),
            prompts,
            n,
            device,
            r,
        ),
    ]
    for mode, session, overlap in (("sched in turn", False, False), ("sched overlap", True, True)):
        if args.no_scheduler:
            break
        stack = SchedulerStack(
            make_engine(models.ours, prompts, n), args.chunk_size, session=session, overlap=overlap
        )
        try:
            results.append(
                timed(
                    mode,
                    lambda p, k, stack=stack: engine_via_scheduler(stack, p, k),
                    prompts,
                    n,
                    device,
                    r,
                )
            )
        finally:
            stack.close()
    return results


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    configure_torch(args)
    transformers.logging.set_verbosity_error()  # the "fast path is not available" notice
    transformers.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="bench_worker_") as tmp:
        model_dir = args.model
        if model_dir is None:
            model_dir = Path(tmp)
            write_random_checkpoint(PRESETS[args.preset](), args.seed, model_dir)
        results = run_benchmark(args, model_dir)
    check_lengths(results, args.max_new_tokens)
    print()
    print_results(results)
    print()
    baseline = results[0]
    for r in results[1:]:
        print(f"greedy tokens, {r.mode} vs {baseline.mode}: {describe_agreement(r, baseline)}")


if __name__ == "__main__":
    main()
