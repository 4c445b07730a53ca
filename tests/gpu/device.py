"""The device the GPU checks run on, and how they compare a run there with another run.

The checks run on CUDA and skip where torch sees no CUDA device. LATTICE_TEST_DEVICE=cpu
runs the same checks with the CPU as "the device" (each comparison is then CPU against
CPU): that checks the checks themselves on a machine without a GPU.

Two ways of comparing, depending on whether the two runs do the same arithmetic:

- Bitwise: the same device and dtype, the same kernels on the same shapes, only the
  place of the data differing (other KV pages, another GDN slot, a state copied in from a
  snapshot or a handoff). Tokens and log-probabilities must then be identical.
- Within a tolerance: another device, or other shapes (other chunking or batching). Greedy
  tokens must be equal up to the first position where the expected run's two most likely
  tokens are nearer than twice the tolerance (a near tie that rounding may break either
  way; after it the runs may diverge), and the log-probabilities there within it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pytest
import torch

from tests.engine.factories import PagedPools
from worker_client.engine.api import ChunkWork, SequenceSpec, StepOutput
from worker_client.engine.model import Qwen35ForCausalLM

DEVICE_ENV = "LATTICE_TEST_DEVICE"
DEVICE = torch.device(os.environ.get(DEVICE_ENV, "cuda"))

# Every module of tests/gpu: slow (they start CUDA and compare whole generations), and
# skipped without the device.
ON_DEVICE = [
    pytest.mark.slow,
    pytest.mark.skipif(
        DEVICE.type == "cuda" and not torch.cuda.is_available(),
        reason=f"no CUDA device visible to torch {torch.__version__} "
        f"({DEVICE_ENV}=cpu runs these checks on the CPU)",
    ),
]

# Log-probabilities of the same tokens in float32 on two devices, or with other shapes:
# about 1e-6 apart (measured on CPU); 1e-3 also admits TF32 matmuls or convolutions, and a
# wrong weight, page, slot or state moves them by 1e-1 or more.
FLOAT32_LOGPROB_ATOL = 1e-3


def report(message: str) -> None:
    """A measurement, shown in the log of a run with -s (scripts/gpu_check_reference.sh)."""
    print(f"[{DEVICE}] {message}", flush=True)


@dataclass(frozen=True)
class Generated:
    """One generated token with its log-probability and the two most likely tokens."""

    token: int
    logprob: float
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]

    @property
    def margin(self) -> float:
        """How much more likely the most likely token was than the runner-up (log space)."""
        return self.top_logprobs[0] - self.top_logprobs[1]


def record(out: StepOutput, into: dict[int, list[Generated]]) -> None:
    """Add the tokens of `out` (with their log-probabilities: specs ask logprobs=2) to `into`."""
    logprobs = dict(out.logprobs)
    for seq_id, tokens in out.tokens:
        for token, lp in zip(tokens, logprobs[seq_id], strict=True):
            into.setdefault(seq_id, []).append(
                Generated(token, lp.logprob, lp.top_token_ids, lp.top_logprobs)
            )


def generate(
    engine,
    specs: Mapping[int, SequenceSpec],
    *,
    chunk_len: int = 32,
    cached: Mapping[int, int] | None = None,
) -> dict[int, list[Generated]]:
    """Admit `specs` together (from `cached[seq_id]` tokens where given: a resume point),
    prefill them in chunks of `chunk_len` packed into each step, decode them batched until
    every one finishes. Nothing may be preempted or miss the cache."""
    cached = cached or {}
    cursors = {seq_id: cached.get(seq_id, 0) for seq_id in specs}
    first = set(specs)
    outputs: dict[int, list[Generated]] = {}
    while first or engine.running_ids() or engine.waiting_ids():
        prefill = []
        for seq_id, spec in specs.items():
            start, prompt_len = cursors[seq_id], len(spec.prompt_token_ids)
            if start < prompt_len and (seq_id in first or seq_id in engine.waiting_ids()):
                is_first = seq_id in first
                length = min(chunk_len, prompt_len - start)
                prefill.append(
                    ChunkWork(
                        seq_id,
                        start,
                        length,
                        spec if is_first else None,
                        cached_tokens=cached.get(seq_id, 0) if is_first else 0,
                    )
                )
                cursors[seq_id] = start + length
        first = set()
        out = engine.step(prefill, engine.running_ids())
        assert not out.preempted and not out.cache_misses, (out.preempted, out.cache_misses)
        record(out, outputs)
    return outputs


def assert_bitwise_equal(
    expected: Mapping[int, list[Generated]], actual: Mapping[int, list[Generated]]
) -> None:
    """The same tokens with the same log-probabilities, to the last bit."""
    assert set(actual) == set(expected)
    for seq_id, want in expected.items():
        got = actual[seq_id]
        assert [g.token for g in got] == [w.token for w in want], f"sequence {seq_id}: tokens"
        differences = [abs(g.logprob - w.logprob) for g, w in zip(got, want)]
        assert got == want, (
            f"sequence {seq_id}: the same tokens, log-probabilities differ by up to "
            f"{max(differences):.3e} where the same arithmetic should give the same bits"
        )


def assert_same_generation(
    expected: Mapping[int, list[Generated]],
    actual: Mapping[int, list[Generated]],
    atol: float = FLOAT32_LOGPROB_ATOL,
    *,
    min_compared: float = 0.5,
) -> float:
    """Greedy tokens equal and log-probabilities within `atol` up to each sequence's first
    near tie in `expected` (see the module's docstring); at least `min_compared` of all
    tokens compared. Returns the largest log-probability difference seen."""
    assert set(actual) == set(expected)
    compared = total = 0
    largest = 0.0
    for seq_id, want in expected.items():
        got = actual[seq_id]
        total += len(want)
        for position, (w, g) in enumerate(zip(want, got)):
            if w.margin <= 2 * atol:
                break  # a near tie: past here the runs may rightly differ
            assert g.token == w.token, (
                f"sequence {seq_id}, token {position}: {g.token} instead of {w.token}, "
                f"whose lead over the runner-up was {w.margin:.3e} (tolerance {atol:.1e})"
            )
            difference = max(
                [abs(g.logprob - w.logprob)]
                + [abs(a - b) for a, b in zip(g.top_logprobs, w.top_logprobs)]
            )
            largest = max(largest, difference)
            assert difference <= atol, (
                f"sequence {seq_id}, token {position}: log-probabilities differ by "
                f"{difference:.3e}, allowed {atol:.1e}"
            )
            compared += 1
        else:
            assert len(got) == len(want), f"sequence {seq_id}: {len(got)} tokens, not {len(want)}"
    assert compared >= min_compared * total, (
        f"only {compared} of {total} tokens before a near tie: too weak a comparison"
    )
    return largest


def teacher_forced_logits(
    model: Qwen35ForCausalLM, token_ids: Sequence[int], prompt_len: int, chunk_len: int
) -> torch.Tensor:
    """Logits [len(token_ids), vocab] (float64, on the host) through the engine's paged path
    on the model's device: the first `prompt_len` tokens prefilled in chunks of `chunk_len`,
    then the rest decoded one token at a time, each fed whatever came before it."""
    device = model.device
    pools = PagedPools(model, num_pages=64, page_size=4, num_slots=1)
    slot = pools.state_pool.acquire()
    rows = []
    with torch.inference_mode():
        for start in list(range(0, prompt_len, chunk_len)) + list(
            range(prompt_len, len(token_ids))
        ):
            end = min(start + chunk_len, prompt_len) if start < prompt_len else start + 1
            positions = torch.arange(start, end, device=device)[None]
            ids = torch.tensor([token_ids[start:end]], device=device)
            logits = model(ids, positions, pools.forward_cache([0], [slot], positions))
            rows.append(logits[0].double().cpu())
    return torch.cat(rows)
