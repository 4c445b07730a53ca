"""The token budget a TPOT target chooses from a worker's learned step times."""

from __future__ import annotations

import pytest

from service.core import Scheduler, SchedulerConfig
from service.core.errors import ConfigError
from service.core.learn.step_model import StepShape, chunk_attention
from tests.unit.factories import FakeClock, register, report, submit


def _scheduler(**overrides) -> Scheduler:
    overrides.setdefault("policy", "budget")
    return Scheduler(SchedulerConfig(**overrides), clock=FakeClock())


def _teach(
    sched: Scheduler, ms_per_prefill_token: float, fixed_ms: float = 10.0, steps: int = 200
) -> None:
    """Make w0's model believe: fixed_ms a step plus ms_per_prefill_token a token."""
    model = sched._step_times.model("w0")
    for i in range(steps):
        tokens = 50 + 37 * (i % 20)
        start = 100 * (i % 7)
        model.observe(
            StepShape(
                num_prefill_tokens=tokens,
                prefill_attention=chunk_attention(start, tokens),
                num_decodes=i % 5,
                decode_context=300 * (i % 3),
            ),
            (fixed_ms + ms_per_prefill_token * tokens) / 1000,
        )


def _prefill_tokens(sched: Scheduler, prompt_len: int = 4000) -> int:
    submit(sched, prompt_len=prompt_len, max_new_tokens=4)
    decision = sched.select_batch(report("w0"))
    return sum(c.chunk_len for c in decision.prefill)


def _learned_prefill_tokens(ms_per_prefill_token: float, **config) -> int:
    """The prompt tokens of the first decision of a scheduler taught that speed."""
    sched = _scheduler(**config)
    register(sched)
    _teach(sched, ms_per_prefill_token=ms_per_prefill_token)
    return _prefill_tokens(sched)


def test_a_tpot_target_sizes_the_budget_from_the_learned_step_time():
    tokens = _learned_prefill_tokens(0.1, tpot_target_ms=100.0, max_seq_len=8192, chunk_size=512)
    # 100 ms less the margin, less 10 ms a step, at 0.1 ms a token: 800 to 850 tokens,
    # rounded down to a multiple of TOKEN_ALIGNMENT (256).
    assert tokens == 768


def test_a_learned_budget_between_256_and_512_tokens_is_not_cut_to_256():
    tokens = _learned_prefill_tokens(0.2, tpot_target_ms=100.0, max_seq_len=8192, chunk_size=512)
    # 100 ms less the 5% margin, less 10 ms a step, at 0.2 ms a token: about 425 tokens.
    # Rounding to a multiple of 256 would keep 256 of them: to a multiple of 32 instead.
    assert tokens == 416


def test_a_slower_worker_gets_a_smaller_budget():
    budgets = [
        _learned_prefill_tokens(ms, tpot_target_ms=100.0, max_seq_len=8192) for ms in (0.1, 0.4)
    ]
    assert budgets[1] < budgets[0] / 3


def test_the_budget_is_never_below_one_min_prefill_chunk():
    # A target of 5 ms: less than a step's 10 ms.
    assert _learned_prefill_tokens(0.1, tpot_target_ms=5.0, min_prefill_chunk=64) == 64


def test_the_budget_is_never_above_an_explicit_max_num_batched_tokens():
    assert (
        _learned_prefill_tokens(
            0.01, tpot_target_ms=1000.0, max_num_batched_tokens=256, max_seq_len=8192
        )
        == 256
    )


def test_without_a_target_the_budget_is_the_fixed_one_and_nothing_is_learned():
    sched = _scheduler(max_num_batched_tokens=300, max_seq_len=8192)
    register(sched)
    assert sched._step_times is None
    assert _prefill_tokens(sched) == 300


def test_targets_are_refused_for_fifo_and_when_negative():
    with pytest.raises(ConfigError, match="tpot_target_ms needs the budget or fair policy"):
        SchedulerConfig(policy="fifo", tpot_target_ms=100.0).validate()
    with pytest.raises(ConfigError, match="ttft_target_ms must be"):
        SchedulerConfig(ttft_target_ms=-1.0).validate()
