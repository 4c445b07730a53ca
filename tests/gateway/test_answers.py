"""From an OpenAI body to the sequence submitted: defaults, limits, seeds, tenant."""

from __future__ import annotations

import json

import pytest

from service.gateway.answers import plan
from service.gateway.errors import GatewayError
from service.gateway.model_files import ModelFiles
from service.gateway.protocol import ChatCompletionRequest, CompletionRequest
from worker_client.demo_model import build_tokenizer, write_tokenizer_files


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> ModelFiles:
    path = tmp_path_factory.mktemp("model")
    write_tokenizer_files(path, build_tokenizer(512))
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [1, 0], "temperature": 0.6, "top_p": 0.95, "top_k": 20})
    )
    return ModelFiles(path)


def completion(**fields) -> CompletionRequest:
    return CompletionRequest(model="m", prompt="hi", **fields)


def planned(files, body, prompt=(5, 6, 7), *, request_id="", max_model_len=64, chat=False):
    max_new = body.max_new_tokens if chat else body.max_tokens
    return plan(
        body,
        list(prompt),
        max_new_tokens=max_new,
        default_max_tokens=None if chat else 16,
        files=files,
        max_model_len=max_model_len,
        request_id=request_id,
    )


def test_absent_sampling_fields_take_generation_config_defaults(files):
    request = planned(files, completion()).attempt.generation
    assert (request.temperature, request.top_p, request.top_k) == (0.6, 0.95, 20)
    explicit = planned(files, completion(temperature=0, top_p=1.0, top_k=-1)).attempt.generation
    assert (explicit.temperature, explicit.top_p, explicit.top_k) == (0, 0.0, 0)


def test_user_becomes_the_tenant_and_priority_passes_through(files):
    request = planned(files, completion(user="alice", priority=-3)).attempt.generation
    assert (request.tenant, request.priority) == ("alice", -3)


def test_the_checkpoints_eos_ids_are_added_to_the_stop_token_ids_once(files):
    request = planned(files, completion(stop_token_ids=[7, 1])).attempt.generation
    assert request.stop_token_ids == (7, 1, 0)


def test_max_tokens_defaults_to_16_for_completions_and_the_rest_of_the_context_for_chat(files):
    assert planned(files, completion()).attempt.generation.max_new_tokens == 16
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    assert planned(files, chat, chat=True).attempt.generation.max_new_tokens == 64 - 3


def test_max_tokens_that_do_not_fit_are_a_400_saying_how_many_would(files):
    with pytest.raises(GatewayError, match="ask for at most 61") as raised:
        planned(files, completion(max_tokens=62))
    assert (raised.value.status, raised.value.param) == (400, "max_tokens")
    with pytest.raises(GatewayError, match="the prompt is 64 tokens"):
        planned(files, completion(), prompt=range(64))


def test_without_a_seed_retries_of_one_key_sample_alike_and_other_requests_do_not(files):
    keyed = [planned(files, completion(), request_id="k").attempt.generation.seed for _ in range(2)]
    assert keyed[0] == keyed[1]
    unkeyed = {planned(files, completion()).attempt.generation.seed for _ in range(5)}
    assert len(unkeyed) > 1
    assert planned(files, completion(seed=-1)).attempt.generation.seed == 2**64 - 1


def test_a_key_or_user_longer_than_the_schedulers_limit_is_a_400(files):
    with pytest.raises(GatewayError, match="longer than 256 bytes"):
        planned(files, completion(), request_id="k" * 257)
    with pytest.raises(GatewayError, match="user is longer"):
        planned(files, completion(user="u" * 257))


def test_null_for_optional_fields_means_their_default(files):
    body = CompletionRequest.model_validate(
        {
            "model": "m",
            "prompt": "hi",
            "n": None,
            "stream": None,
            "priority": None,
            "echo": None,
            "stop": None,
            "max_tokens": None,
        }
    )
    request = planned(files, body).attempt.generation
    assert (request.priority, request.max_new_tokens) == (0, 16)


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)


def test_logprobs_0_still_asks_the_scheduler_for_each_tokens_logprob(files):
    work = planned(files, completion(logprobs=0))
    # The scheduler's 0 is "none": the gateway asks for one alternative and shows none.
    assert (work.attempt.generation.logprobs, work.num_top_logprobs) == (1, 0)
    assert work.attempt.generation.prompt_logprobs == 0 and not work.echo
    work = planned(files, completion(logprobs=5))
    assert (work.attempt.generation.logprobs, work.num_top_logprobs) == (5, 5)
    assert planned(files, completion()).num_top_logprobs is None
    assert planned(files, completion()).attempt.generation.logprobs == 0


def test_echo_with_max_tokens_0_asks_for_prompt_logprobs_and_drops_the_one_token(files):
    work = planned(files, completion(echo=True, logprobs=1, max_tokens=0))
    request = work.attempt.generation
    assert (request.prompt_logprobs, request.max_new_tokens, request.logprobs) == (1, 1, 0)
    assert work.echo and work.discard_generated


@pytest.mark.parametrize(
    "body, param",
    [
        (lambda: completion(max_tokens=0), "max_tokens"),  # 0 only with echo
        (lambda: chat(max_tokens=0), "max_tokens"),
        (lambda: completion(logprobs=6), "logprobs"),
        (lambda: chat(logprobs=True, top_logprobs=21), "top_logprobs"),
        (lambda: chat(top_logprobs=2), "top_logprobs"),  # without logprobs: true
        (lambda: completion(min_tokens=20, max_tokens=10), "min_tokens"),
    ],
)
def test_out_of_range_logprobs_and_lengths_are_400s_naming_the_field(files, body, param):
    with pytest.raises((GatewayError, ValueError)) as raised:
        planned(files, body())
    if isinstance(raised.value, GatewayError):
        assert raised.value.param == param
    else:  # pydantic's range check (the app answers it as a 400 naming the field)
        assert param in str(raised.value)


def test_chat_top_logprobs_pass_through_and_0_means_each_tokens_own(files):
    work = planned(files, chat(logprobs=True, top_logprobs=0), chat=True)
    assert (work.attempt.generation.logprobs, work.num_top_logprobs) == (1, 0)
    work = planned(files, chat(logprobs=True, top_logprobs=20), chat=True)
    assert (work.attempt.generation.logprobs, work.num_top_logprobs) == (20, 20)


def test_ignore_eos_leaves_the_eos_ids_out_of_the_stop_tokens_and_min_tokens_pass(files):
    request = planned(
        files, completion(stop_token_ids=[7], ignore_eos=True, min_tokens=4)
    ).attempt.generation
    assert request.stop_token_ids == (7,)
    assert (request.ignore_eos, request.min_new_tokens) == (True, 4)
    plain = planned(files, completion()).attempt.generation
    assert (plain.ignore_eos, plain.min_new_tokens, plain.stop_token_ids) == (False, 0, (1, 0))
