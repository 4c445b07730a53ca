"""The worker's wire mapping of the sampling fields and of log-probabilities: a spec's
fields reach the engine, and a report keeps logprobs with their tokens across a lost answer."""

from __future__ import annotations

from lattice.scheduler.v1 import scheduler_pb2 as pb
from worker_client.convert import PendingReport, chunk_work
from worker_client.engine.api import ChunkWork, SequenceSpec, StepOutput, TokenLogprobs
from worker_client.testing import ScriptedEngine, scripted_logprobs


def _request(pending: PendingReport) -> pb.SelectBatchRequest:
    return pending.request(
        "w0", waiting=(), running=(), kv_free_pages=1, gdn_free_slots=1, draining=False
    )


def test_a_specs_logprobs_and_length_fields_reach_the_engine():
    chunk = pb.PrefillChunk(
        seq_id=3,
        chunk_start=0,
        chunk_len=2,
        spec=pb.SequenceSpec(
            prompt_token_ids=[5, 6],
            max_new_tokens=4,
            sampling=pb.SamplingParams(
                logprobs=3, prompt_logprobs=2, ignore_eos=True, min_new_tokens=2
            ),
        ),
    )
    spec = chunk_work(chunk).spec
    assert (spec.logprobs, spec.prompt_logprobs, spec.ignore_eos, spec.min_new_tokens) == (
        3,
        2,
        True,
        2,
    )
    assert spec.needs_all_prompt_logits


def test_logprobs_stay_with_their_tokens_when_an_answer_is_lost():
    pending = PendingReport()
    pending.admitted(3)
    prompt = (TokenLogprobs(-1.0, (4,), (-0.5,)),)
    pending.add(
        StepOutput(
            ((3, (7,)),),
            (),
            (),
            logprobs=((3, (TokenLogprobs(-0.125, (7,), (-0.125,)),)),),
            prompt_logprobs=((3, prompt),),
        )
    )
    _request(pending)  # the answer to this one is lost: nothing delivered
    pending.add(
        StepOutput(((3, (8,)),), (), (), logprobs=((3, (TokenLogprobs(-0.25, (8,), (-0.25,)),)),))
    )
    (update,) = _request(pending).tokens
    assert list(update.token_ids) == [7, 8] and update.offset == 0
    assert [e.logprob for e in update.logprobs] == [-0.125, -0.25]
    assert [e.logprob for e in update.prompt_logprobs] == [-1.0]
    pending.delivered()
    pending.add(StepOutput(((3, (9,)),), (), (), logprobs=((3, (TokenLogprobs(-0.375),)),)))
    (update,) = _request(pending).tokens
    assert update.offset == 2 and [e.logprob for e in update.logprobs] == [-0.375]
    assert not update.prompt_logprobs


def test_the_scripted_engine_reports_its_documented_fake_logprobs_and_min_new_tokens():
    engine = ScriptedEngine()
    prompt = (5, 6, 7)
    spec = SequenceSpec(prompt, max_new_tokens=2, logprobs=2, prompt_logprobs=1)
    out = engine.step([ChunkWork(1, 0, 3, spec)], [])
    ((_, (token,)),) = out.tokens
    ((_, (generated,)),) = out.logprobs
    assert generated == scripted_logprobs(prompt, token, 2)
    assert generated.top_token_ids[0] == token  # the scripted token is the most likely
    ((_, prompt_lps),) = out.prompt_logprobs
    assert prompt_lps == (scripted_logprobs(prompt[:1], 6, 1), scripted_logprobs(prompt[:2], 7, 1))
    # min_new_tokens holds off a stop token: stop on the first token, at least 3 tokens.
    held = SequenceSpec(prompt, max_new_tokens=5, stop_token_ids=(token,), min_new_tokens=3)
    engine = ScriptedEngine()
    tokens = [t for _, ids in engine.step([ChunkWork(1, 0, 3, held)], []).tokens for t in ids]
    while 1 in engine.running_ids():
        tokens += [t for _, ids in engine.step([], [1]).tokens for t in ids]
    assert len(tokens) >= 3 and tokens[0] == token
