"""Log-probabilities (generated and prompt tokens) equal transformers' log_softmax on the
same checkpoint, across prefill chunks and packed prefill; and the length controls
(ignore_eos, min_new_tokens) in the engine's stop rules."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from worker_client.engine.api import ChunkWork, FinishReason, SequenceSpec
from worker_client.engine.loading import load_model

from .factories import chunks_for, make_engine, random_prompt
from .tolerance import Float64Transformers, assert_float64_equal

NUM_TOP = 3


@pytest.fixture(scope="module")
def models(hf_checkpoint):
    return Float64Transformers(hf_checkpoint.reference), load_model(
        hf_checkpoint.path, dtype=torch.float64
    )


def _collect(engine, seq_id, spec, chunk_lengths, others=()):
    """Run `spec` in these chunks (packed with `others`' whole prompts in the first step),
    then decode it to the end; its tokens, their logprobs and its prompt logprobs."""
    tokens, logprobs, prompt_logprobs = [], [], None
    steps = [[chunk] for chunk in chunks_for(seq_id, spec, chunk_lengths)]
    steps[0] = [*[ChunkWork(i, 0, len(s.prompt_token_ids), s) for i, s in others], *steps[0]]
    pending = steps + [[]] * (spec.max_new_tokens + 1)
    for prefill in pending:
        decode = [seq_id] if seq_id in engine.running_ids() and not prefill else []
        if not prefill and not decode:
            break
        out = engine.step(prefill, decode)
        tokens += [t for s, ids in out.tokens if s == seq_id for t in ids]
        logprobs += [lp for s, lps in out.logprobs if s == seq_id for lp in lps]
        for s, lps in out.prompt_logprobs:
            if s == seq_id:
                assert prompt_logprobs is None, "prompt logprobs come once, with the first token"
                prompt_logprobs = lps
    return tokens, logprobs, prompt_logprobs


def _assert_matches(expected_logprobs: torch.Tensor, targets: list[int], got) -> None:
    """`got` (TokenLogprobs per row) equals the rows of `expected_logprobs` [rows, vocab]."""
    assert len(got) == len(targets)
    chosen = torch.tensor([lp.logprob for lp in got], dtype=torch.float64)
    assert_float64_equal(
        chosen, expected_logprobs[torch.arange(len(targets)), torch.tensor(targets)]
    )
    for row, lp in enumerate(got):
        top = torch.sort(expected_logprobs[row], descending=True, stable=True)
        assert list(lp.top_token_ids) == top.indices[:NUM_TOP].tolist()
        assert_float64_equal(
            torch.tensor(lp.top_logprobs, dtype=torch.float64), top.values[:NUM_TOP]
        )


@pytest.mark.parametrize(
    "chunk_lengths",
    [[23], [5, 1, 9, 8], [70, 30]],
    ids=["one-chunk", "four-chunks", "over-64-rows"],
)
def test_prompt_and_generated_logprobs_equal_transformers_log_softmax(models, chunk_lengths):
    hf64, ours64 = models
    prompt = random_prompt(sum(chunk_lengths), seed=5)
    spec = SequenceSpec(
        prompt, max_new_tokens=4, logprobs=NUM_TOP, prompt_logprobs=NUM_TOP, ignore_eos=True
    )
    # Another sequence packed into the first prefill forward, without logprobs.
    other = (7, SequenceSpec(random_prompt(11, seed=6), max_new_tokens=2))
    tokens, logprobs, prompt_logprobs = _collect(
        make_engine(ours64), 1, spec, chunk_lengths, [other]
    )
    assert len(tokens) == 4
    expected = torch.log_softmax(hf64.logits(list(prompt) + tokens[:-1]), dim=-1)
    _assert_matches(expected[: len(prompt) - 1], list(prompt[1:]), prompt_logprobs)
    _assert_matches(expected[len(prompt) - 1 :], tokens, logprobs)
    # Greedy: the sampled token is the most likely one.
    assert [lp.top_token_ids[0] for lp in logprobs] == tokens


def test_logprobs_come_from_the_raw_distribution_not_the_tempered_one(models):
    hf64, ours64 = models
    prompt = random_prompt(9, seed=8)
    spec = SequenceSpec(prompt, max_new_tokens=1, temperature=0.3, seed=4, logprobs=NUM_TOP)
    tokens, logprobs, prompt_logprobs = _collect(make_engine(ours64), 1, spec, [9])
    assert prompt_logprobs is None  # not asked for
    expected = torch.log_softmax(hf64.logits(list(prompt)), dim=-1)[-1:]
    _assert_matches(expected, tokens, logprobs)


def test_zero_top_logprobs_still_gives_each_tokens_logprob(models):
    _, ours64 = models
    spec = SequenceSpec(random_prompt(6, seed=9), max_new_tokens=2, logprobs=0, prompt_logprobs=0)
    out = make_engine(ours64).step(chunks_for(1, spec, [6]), [])
    assert out.logprobs == () and out.prompt_logprobs == ()  # 0 = none on the engine's API


def _finish(engine, spec):
    """Run `spec` alone to its end: its tokens and its FinishedSequence."""
    tokens = []
    out = engine.step(chunks_for(1, spec, [len(spec.prompt_token_ids)]), [])
    while True:
        tokens += [t for _, ids in out.tokens for t in ids]
        if out.finished:
            return tokens, out.finished[0]
        out = engine.step([], [1])


@pytest.fixture(scope="module")
def eos_setup():
    """A tiny model whose EOS is the first token it generates greedily for `prompt`, so
    that a plain run ends at once with EOS."""
    prompt = random_prompt(5, seed=2)
    model = load_model("tiny", device="cpu", dtype=torch.float32, seed=0)
    first, _ = _finish(make_engine(model), SequenceSpec(prompt, max_new_tokens=1))
    model.config = dataclasses.replace(model.config, eos_token_ids=(first[0],))
    return model, prompt, first[0]


def test_ignore_eos_generates_exactly_max_new_tokens(eos_setup):
    model, prompt, eos = eos_setup
    tokens, finished = _finish(make_engine(model), SequenceSpec(prompt, max_new_tokens=8))
    assert tokens == [eos] and finished.reason is FinishReason.EOS
    tokens, finished = _finish(
        make_engine(model), SequenceSpec(prompt, max_new_tokens=8, ignore_eos=True)
    )
    assert len(tokens) == 8 and finished.reason is FinishReason.MAX_LENGTH
    assert tokens[0] == eos


@pytest.mark.parametrize("as_stop_token", [False, True], ids=["eos", "stop-token"])
def test_min_new_tokens_holds_off_eos_and_stop_tokens(eos_setup, as_stop_token):
    model, prompt, eos = eos_setup
    # As a stop token: with ignore_eos, so that only the stop rule can end it.
    stop = dict(stop_token_ids=(eos,), ignore_eos=True) if as_stop_token else {}
    free_run, _ = _finish(
        make_engine(model), SequenceSpec(prompt, max_new_tokens=12, ignore_eos=True)
    )
    tokens, finished = _finish(
        make_engine(model), SequenceSpec(prompt, max_new_tokens=12, min_new_tokens=3, **stop)
    )
    # It ends at the first EOS among tokens 3.. (1-based), else at max_new_tokens.
    ends = [i + 1 for i, t in enumerate(free_run) if t == eos and i + 1 >= 3]
    expected_len = ends[0] if ends else 12
    assert tokens == free_run[:expected_len]
    assert finished.generated_tokens == expected_len
    if ends:
        assert finished.reason is (FinishReason.STOP if as_stop_token else FinishReason.EOS)
