"""Prefix caching through the scheduler, caching on against off, side by side (the
figures of docs/prefix-caching.md, "Figures").

Each scenario runs a real scheduler on a loopback port and a WorkerLoop on a ModelEngine
(bench.harness.engine_bench.SchedulerStack), once with the engine's cache and
`--prefix-caching on`, once with `--prefix-caching off` (the same engine settings):

- turn2: a conversation's second turn (prompt = turn 1's prompt + its answer + 64 new
  tokens): computed prefill tokens (the scheduler's prefill_tokens_total) and TTFT;
- shared: one request with a 1,024-token system prompt, then 31 more at once, each with
  its own part: computed prefill tokens against the bound of one
  shared prefix computed once;
- random: prompts that share nothing, all at once: generated tokens per second;
- memory: bytes per snapshot slot and per cached block, beside one sequence's GDN state.

    .venv/bin/python -m bench.prefix_cache --presets tiny small

Wall-clock figures depend on the machine's load: print `uptime` beside them.
"""

from __future__ import annotations

import argparse
import math
import random
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from bench.harness.engine_bench import PAGE_SIZE, SchedulerStack
from worker_client.engine.engine import ModelEngine
from worker_client.engine.loading import PRESETS, random_model
from worker_client.engine.sizing import gdn_slot_bytes, kv_page_bytes

BLOCK = 64  # cache_block_tokens: 4 pages of 16
COMPUTED = "lattice_scheduler_prefill_tokens_total"


def tokens(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(2, min(vocab, 50_000)) for _ in range(n))


def engine_for(model, num_seqs: int, max_tokens: int) -> ModelEngine:
    pages = num_seqs * (math.ceil(max_tokens / PAGE_SIZE) + 1) * 2  # room for the cache too
    return ModelEngine(
        model,
        total_kv_pages=pages,
        page_size=PAGE_SIZE,
        total_gdn_slots=num_seqs,
        device="cpu",
        max_batch_size=num_seqs,
        cache_block_tokens=BLOCK,
        total_snapshot_slots=4 * num_seqs,
    )


def computed(stack: SchedulerStack) -> float:
    return stack.metric(COMPUTED, source="computed")


def turn2(model, vocab: int, caching: str, args) -> dict[str, float]:
    rng = random.Random(1)
    first = tokens(rng, args.turn1_tokens, vocab)
    stack = SchedulerStack(
        engine_for(model, 2, args.turn1_tokens + 256), args.chunk_size, prefix_caching=caching
    )
    try:
        answer, _ = stack.generate(first, args.answer_tokens)
        second = first + answer + tokens(rng, 64, vocab)
        before = computed(stack)
        answer2, ttft = stack.generate(second, args.answer_tokens)
        return {
            "prompt": len(second),
            "computed": computed(stack) - before,
            "cached": stack.metric(COMPUTED, source="cached"),
            "ttft_s": ttft,
            "answer": hash(answer2),
        }
    finally:
        stack.close()


def shared(model, vocab: int, caching: str, args) -> dict[str, float]:
    rng = random.Random(2)
    system = tokens(rng, 1024, vocab)
    prompts = [system + tokens(rng, args.own_tokens, vocab) for _ in range(32)]
    stack = SchedulerStack(
        engine_for(model, 32, 1024 + args.own_tokens + 8), args.chunk_size, prefix_caching=caching
    )
    try:
        stack.generate(prompts[0], 2)
        with ThreadPoolExecutor(31) as pool:
            list(pool.map(lambda p: stack.generate(p, 2), prompts[1:]))
        return {"computed": computed(stack), "bound": 1024 + 32 * (args.own_tokens + BLOCK)}
    finally:
        stack.close()


def random_prompts(model, vocab: int, caching: str, args) -> dict[str, float]:
    rng = random.Random(3)
    prompts = [tokens(rng, args.random_tokens, vocab) for _ in range(args.random_prompts)]
    stack = SchedulerStack(
        engine_for(model, len(prompts), args.random_tokens + 64),
        args.chunk_size,
        prefix_caching=caching,
    )
    try:
        started, cpu_started = time.perf_counter(), time.process_time()
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda p: stack.generate(p, args.new_tokens)[0], prompts))
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        generated = sum(len(o) for o in outs)
        # CPU time of this process (scheduler, worker loop and engine threads together):
        # less sensitive to the machine's load than the wall clock.
        return {"tokens_per_s": generated / seconds, "cpu_ms_per_token": 1000 * cpu / generated}
    finally:
        stack.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.prefix_cache", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--presets", nargs="+", default=["tiny"], choices=sorted(PRESETS))
    parser.add_argument("--scenarios", nargs="+", default=["turn2", "shared", "random", "memory"])
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--turn1-tokens", type=int, default=512)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--own-tokens", type=int, default=32)
    parser.add_argument("--random-prompts", type=int, default=8)
    parser.add_argument("--random-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("load:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    for preset in args.presets:
        config = PRESETS[preset]()
        model = random_model(config, seed=0).eval()
        vocab = config.vocab_size
        print(f"\n== {preset} (float32, CPU, block {BLOCK} tokens, chunk {args.chunk_size})")
        if "turn2" in args.scenarios:
            on, off = (turn2(model, vocab, c, args) for c in ("on", "off"))
            print(
                f"turn2: prompt {on['prompt']} tokens; computed prefill on {on['computed']:.0f}"
                f" / off {off['computed']:.0f} (target <= 64 new + one block = {64 + BLOCK});"
                f" TTFT on {on['ttft_s']:.3f} s / off {off['ttft_s']:.3f} s = "
                f"{on['ttft_s'] / off['ttft_s']:.2f}x (target <= 0.3x); "
                f"same answer: {on['answer'] == off['answer']}"
            )
        if "shared" in args.scenarios:
            on, off = (shared(model, vocab, c, args) for c in ("on", "off"))
            print(
                f"shared 1024 x 32: computed prefill on {on['computed']:.0f} / off "
                f"{off['computed']:.0f} (bound {on['bound']})"
            )
        if "random" in args.scenarios:
            # On and off in turn, the best of --repeats each: the machine's load moves.
            runs = {"on": [], "off": []}
            for _ in range(args.repeats):
                for caching in ("on", "off"):
                    runs[caching].append(random_prompts(model, vocab, caching, args))
            on, off = (max(r["tokens_per_s"] for r in runs[c]) for c in ("on", "off"))
            cpu_on, cpu_off = (min(r["cpu_ms_per_token"] for r in runs[c]) for c in ("on", "off"))
            print(
                f"random {args.random_prompts} x {args.random_tokens} (best of {args.repeats}):"
                f" {on:.1f} / {off:.1f} generated tokens/s = {on / off:.2f}x (target >= 0.95x);"
                f" CPU {cpu_on:.2f} / {cpu_off:.2f} ms per generated token = "
                f"{cpu_off / cpu_on:.2f}x; every run's tokens/s on "
                f"{[round(r['tokens_per_s']) for r in runs['on']]} off "
                f"{[round(r['tokens_per_s']) for r in runs['off']]}"
            )
        if "memory" in args.scenarios:
            slot = gdn_slot_bytes(config, torch.float32)
            block = (BLOCK // PAGE_SIZE) * kv_page_bytes(config, PAGE_SIZE, torch.float32)
            print(
                f"memory: snapshot slot {slot:,} B (= one sequence's GDN state {slot:,} B); "
                f"cached block of {BLOCK} tokens {block:,} B"
            )
    print("load:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
