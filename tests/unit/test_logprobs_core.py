"""The core carries log-probabilities with their tokens: a retried report adds none twice,
a resumed sequence keeps those delivered (and asks for no prompt logprobs again), and after
a restart the tokens restored have none (not persisted) while the sampling fields survive."""

from __future__ import annotations

import pytest

from service.core import SamplingParams, TokenLogprobs, TokenRuns, TokenUpdate, WorkerReport
from service.core.types import SequenceState
from tests.unit.factories import admit, make_scheduler, register, report, submit
from tests.unit.test_durable_state import Restartable

ASKING = SamplingParams(logprobs=2, prompt_logprobs=1, min_new_tokens=3, ignore_eos=True)


def lp(value: float) -> TokenLogprobs:
    return TokenLogprobs(value, (9, 8), (value, value - 1))


def _tokens(sched, seq_id, *updates: TokenUpdate) -> None:
    sched.select_batch(
        WorkerReport("w0", running=(seq_id,), kv_free_pages=100, gdn_free_slots=8, tokens=updates)
    )


def _running(sched, **overrides) -> int:
    register(sched)
    seq_id = submit(sched, prompt_len=4, max_new_tokens=10, sampling=ASKING, **overrides)
    admit(sched)
    return seq_id


def test_logprobs_of_a_retried_report_are_applied_once_and_prompt_logprobs_come_first():
    sched = make_scheduler()
    seq_id = _running(sched)
    prompt = (lp(-1.0), lp(-2.0), lp(-3.0))
    _tokens(sched, seq_id, TokenUpdate(seq_id, (11, 12), 0, (lp(-0.1), lp(-0.2)), prompt))
    # The answer was lost: the worker resends, with one more token.
    _tokens(
        sched, seq_id, TokenUpdate(seq_id, (11, 12, 13), 0, (lp(-0.1), lp(-0.2), lp(-0.3)), prompt)
    )
    view = sched.read_output(seq_id, 0)
    assert view.token_ids == (11, 12, 13)
    assert [e.logprob for e in view.logprobs] == [-0.1, -0.2, -0.3]
    assert view.prompt_logprobs == prompt
    later = sched.read_output(seq_id, 2)
    assert [e.logprob for e in later.logprobs] == [-0.3] and later.prompt_logprobs == ()


def test_a_report_mixing_token_updates_and_packed_runs_keeps_logprobs_with_their_tokens():
    sched = make_scheduler()
    register(sched)
    asking = submit(sched, prompt_len=4, max_new_tokens=10, sampling=ASKING)
    plain = submit(sched, prompt_len=4, max_new_tokens=10)
    assert set(admit(sched)) == {asking, plain}
    prompt = (lp(-1.0), lp(-2.0), lp(-3.0))

    def tokens(**kw) -> None:
        sched.select_batch(
            WorkerReport("w0", running=(asking, plain), kv_free_pages=100, gdn_free_slots=8, **kw)
        )

    # `asking` twice in one report (the second update overlaps the first), and once more
    # in a packed run (which carries no logprobs); `plain` only packed.
    tokens(
        tokens=(
            TokenUpdate(asking, (11, 12), 0, (lp(-0.1), lp(-0.2)), prompt),
            TokenUpdate(asking, (12, 13), 1, (lp(-0.2), lp(-0.3)), prompt),
        ),
        token_runs=TokenRuns((plain, asking), (21, 14), offsets=(0, 3)),
    )
    # The answer was lost: the worker resends it all, with one more token each.
    tokens(
        tokens=(
            TokenUpdate(
                asking, (11, 12, 13, 14, 15), 0, tuple(lp(-x / 10) for x in range(1, 6)), prompt
            ),
        ),
        token_runs=TokenRuns((plain,), (21, 22), counts=(2,), offsets=(0,)),
    )
    # Each token once, its logprob beside it; the packed token's is unknown, and a read
    # never mixes tokens with and without logprobs (docs/contract.md), so it ends there.
    view = sched.read_output(asking, 0)
    assert view.token_ids == (11, 12, 13)
    assert [e.logprob for e in view.logprobs] == [-0.1, -0.2, -0.3]
    assert view.prompt_logprobs == prompt
    unknown = sched.read_output(asking, 3)
    assert unknown.token_ids == (14,) and not any(unknown.logprobs)
    last = sched.read_output(asking, 4)
    assert last.token_ids == (15,) and [e.logprob for e in last.logprobs] == [-0.5]
    assert sched.read_output(plain, 0).token_ids == (21, 22)


def test_a_resumed_sequence_keeps_its_logprobs_and_asks_for_no_prompt_logprobs_again():
    sched = make_scheduler()
    seq_id = _running(sched)
    _tokens(sched, seq_id, TokenUpdate(seq_id, (11,), 0, (lp(-0.1),), (lp(-1.0),) * 3))
    sched.select_batch(report(preempted=(seq_id,), gdn_free_slots=0))
    decision = sched.select_batch(report())
    (chunk,) = [c for c in decision.prefill if c.seq_id == seq_id]
    sampling = chunk.spec.sampling
    assert chunk.spec.prompt_token_ids[-1] == 11
    assert (
        sampling.prompt_logprobs,
        sampling.logprobs,
        sampling.min_new_tokens,
        sampling.ignore_eos,
    ) == (0, 2, 2, True)
    _tokens(sched, seq_id, TokenUpdate(seq_id, (12,), 0, (lp(-0.2),)))
    view = sched.read_output(seq_id, 0)
    assert view.token_ids == (11, 12)
    assert [e.logprob for e in view.logprobs] == [-0.1, -0.2]


def test_a_sequence_that_asked_for_nothing_carries_no_logprobs():
    sched = make_scheduler()
    register(sched)
    seq_id = submit(sched, prompt_len=4, max_new_tokens=10)
    admit(sched)
    _tokens(sched, seq_id, TokenUpdate(seq_id, (11,), 0, (lp(-0.1),)))
    view = sched.read_output(seq_id, 0)
    assert view.token_ids == (11,) and view.logprobs == () and view.prompt_logprobs == ()
    assert sched._sequences.get(seq_id).output_logprobs is None  # no per-token cost


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_after_a_restart_restored_tokens_have_no_logprobs_and_new_ones_do(kind, tmp_path):
    state = Restartable(kind, tmp_path)
    seq_id = _running(state.sched)
    _tokens(
        state.sched, seq_id, TokenUpdate(seq_id, (11, 12), 0, (lp(-0.1), lp(-0.2)), (lp(-1.0),) * 3)
    )
    sched = state.restart()
    assert sched._sequences.get(seq_id).params.sampling == ASKING  # persisted
    register(sched)
    if sched.get_sequence(seq_id).state is SequenceState.QUEUED:
        admit(sched)
    _tokens(sched, seq_id, TokenUpdate(seq_id, (13,), 0, (lp(-0.3),)))
    before = sched.read_output(seq_id, 0)
    # A view never mixes tokens with and without logprobs.
    assert before.token_ids == (11, 12) and before.logprobs == () and before.prompt_logprobs == ()
    after = sched.read_output(seq_id, 2)
    assert after.token_ids == (13,) and [e.logprob for e in after.logprobs] == [-0.3]
