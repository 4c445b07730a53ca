"""The scheduler's wire mapping of the sampling fields (logprobs, stop, seed, penalties) (SubmitRequest -> core)."""

from __future__ import annotations

import pytest

from lattice.scheduler.v1 import scheduler_pb2 as pb
from service.core import InvalidArgument
from service.server import convert


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_more_than_20_logprobs_is_refused_naming_the_field(name):
    ok = pb.SubmitRequest(
        prompt_token_ids=[1],
        max_new_tokens=1,
        sampling=pb.SamplingParams(**{name: 20}, ignore_eos=True, min_new_tokens=1),
    )
    sampling = convert.submit_params(ok).sampling
    assert (getattr(sampling, name), sampling.ignore_eos, sampling.min_new_tokens) == (20, True, 1)
    with pytest.raises(InvalidArgument, match=f"sampling.{name} is 21; at most 20"):
        convert.submit_params(
            pb.SubmitRequest(
                prompt_token_ids=[1], max_new_tokens=1, sampling=pb.SamplingParams(**{name: 21})
            )
        )
