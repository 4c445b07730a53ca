"""The gateway through the official `openai` client, against a real scheduler, worker and
gateway on loopback; greedy text is checked against transformers on the same checkpoint."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest

from common.processes import GATEWAY_LISTENING, LOOPBACK, gateway_argv, spawn
from common.waiting import wait_until
from lattice.scheduler.v1 import scheduler_pb2 as pb

from .conftest import REATTACH_GRACE_SECONDS, Stack

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

# Prompts whose greedy continuations mix ASCII and multi-byte characters split across
# byte tokens. (The checkpoint's greedy runs never reach EOS: see checkpoint.py.)
PROMPTS = ["Hello world", "The scheduler admits", "Café 日本語 🚀"]
LONG_PROMPT = "The scheduler admits"
MAX_TOKENS = 24


def seq_id_of(response_id: str) -> int:
    return int(response_id.rsplit("-", 1)[1])


def metric_value(url: str, sample: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(sample + " "):
                return float(line.split()[-1])
    return 0.0


def test_models_lists_the_served_model(stack: Stack):
    models = stack.client().models.list()
    assert [m.id for m in models.data] == [stack.model_name]


def test_health_is_ok_while_the_scheduler_serves(stack: Stack):
    with urllib.request.urlopen(f"{stack.base_url}/health", timeout=10) as response:
        assert json.loads(response.read()) == {"status": "ok"}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completion_text_equals_transformers_generate_then_decode(stack: Stack, prompt):
    prompt_ids = stack.checkpoint.tokenizer.encode(prompt)
    expected_ids = stack.checkpoint.greedy_ids(prompt_ids, MAX_TOKENS)
    answer = stack.client().completions.create(
        model=stack.model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
    )
    choice = answer.choices[0]
    assert choice.text == stack.checkpoint.tokenizer.decode(expected_ids, skip_special_tokens=True)
    assert choice.finish_reason == "length"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (
        len(prompt_ids),
        len(expected_ids),
    )


def test_streamed_completion_adds_up_to_the_same_text_and_ends_with_usage(stack: Stack):
    prompt = PROMPTS[2]
    expected = stack.checkpoint.greedy_text(stack.checkpoint.tokenizer.encode(prompt), MAX_TOKENS)
    chunks = list(
        stack.client().completions.create(
            model=stack.model_name,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == expected
    # A character split across tokens arrives whole: no piece carries half of one.
    assert all("\ufffd" not in t for t in texts) or "\ufffd" in expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_prompt_is_the_checkpoints_chat_template_and_text_equals_transformers(stack: Stack):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello 日本!"},
    ]
    tokenizer = stack.checkpoint.tokenizer
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)[
        "input_ids"
    ]
    expected = stack.checkpoint.greedy_text(prompt_ids, MAX_TOKENS)
    client = stack.client()
    answer = client.chat.completions.create(
        model=stack.model_name, messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == expected
    assert answer.usage.prompt_tokens == len(prompt_ids)
    chunks = list(
        client.chat.completions.create(
            model=stack.model_name,
            messages=messages,
            max_completion_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == answer.choices[0].finish_reason


def test_stop_string_ends_the_text_before_it_and_cancels_the_sequence(stack: Stack):
    prompt_ids = stack.checkpoint.tokenizer.encode(LONG_PROMPT)
    reference = stack.checkpoint.greedy_text(prompt_ids, 40)
    start = len(reference) // 2
    stop = next(
        reference[i : i + 2]
        for i in range(start, len(reference) - 1)
        if reference[i : i + 2].isprintable() and "\ufffd" not in reference[i : i + 2]
    )
    expected = reference[: reference.find(stop)]
    for stream in (False, True):
        created = stack.client().completions.create(
            model=stack.model_name,
            prompt=LONG_PROMPT,
            max_tokens=2000,
            temperature=0,
            stop=[stop, "never appears \u2603"],
            stream=stream,
        )
        chunks = list(created) if stream else [created]
        assert "".join(c.choices[0].text for c in chunks) == expected
        assert chunks[-1].choices[0].finish_reason == "stop"
        seq_id = seq_id_of(chunks[0].id)
        info = wait_until(
            lambda seq_id=seq_id: stack.sequence(seq_id),
            f"seq_id {seq_id} to end",
            30,
            done=lambda i: i.state == pb.SEQUENCE_STATE_FINISHED,
        )
        assert info.finish_reason == pb.FINISH_REASON_CANCELLED
        assert info.generated_tokens < 2000


def test_stop_token_id_ends_the_sequence_with_finish_reason_stop(stack: Stack):
    prompt_ids = stack.checkpoint.tokenizer.encode(LONG_PROMPT)
    reference_ids = stack.checkpoint.greedy_ids(prompt_ids, MAX_TOKENS)
    stop_id = reference_ids[5]
    answer = stack.client().completions.create(
        model=stack.model_name,
        prompt=LONG_PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"stop_token_ids": [stop_id]},
    )
    upto = reference_ids[: reference_ids.index(stop_id) + 1]
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens == len(upto)
    assert answer.choices[0].text == stack.checkpoint.tokenizer.decode(
        upto, skip_special_tokens=True
    )


def test_n_over_eight_is_a_400_that_names_n(stack: Stack):
    # n up to 8 is served: n sequences, one response.
    with pytest.raises(openai.BadRequestError) as raised:
        stack.client().completions.create(model=stack.model_name, prompt="hi", n=9)
    assert raised.value.status_code == 400
    assert raised.value.body["param"] == "n" and "n=9" in raised.value.body["message"]


def test_n_choices_are_n_sequences_in_one_response(stack: Stack):
    fields = dict(
        model=stack.model_name,
        prompt=PROMPTS[1],
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        n=3,
        seed=7,
    )
    answer = stack.client().completions.create(**fields)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert 3 <= answer.usage.completion_tokens <= 3 * MAX_TOKENS
    # Choice i samples with seed 7 + i: the same request gives the same three texts.
    again = stack.client().completions.create(**fields)
    assert [c.text for c in again.choices] == [c.text for c in answer.choices]


def test_unknown_model_is_a_404_naming_the_served_one(stack: Stack):
    with pytest.raises(openai.NotFoundError) as raised:
        stack.client().chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
        )
    assert raised.value.body["code"] == "model_not_found"
    assert stack.model_name in raised.value.body["message"]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"max_tokens": 5000}, "max_tokens"),
        ({"extra_body": {"top_k": -5}}, "top_k"),
        ({"logprobs": 6}, "logprobs"),  # 0..5 (OpenAI)
    ],
)
def test_bad_parameters_are_400s_in_openai_error_json(stack: Stack, fields, param):
    with pytest.raises(openai.BadRequestError) as raised:
        stack.client().completions.create(model=stack.model_name, prompt="hi", **fields)
    assert raised.value.body["type"] == "invalid_request_error"
    assert raised.value.body["param"] == param


def test_a_retry_with_the_same_idempotency_key_gets_the_same_sequence(stack: Stack):
    client = stack.client()
    key = {"Idempotency-Key": "test-retry-same-sequence"}
    first = client.completions.create(
        model=stack.model_name,
        prompt=PROMPTS[1],
        max_tokens=MAX_TOKENS,
        temperature=0.8,
        extra_headers=key,
    )
    # After the first has finished: the scheduler re-attaches the key to its sequence.
    again = client.completions.create(
        model=stack.model_name,
        prompt=PROMPTS[1],
        max_tokens=MAX_TOKENS,
        temperature=0.8,
        extra_headers=key,
    )
    assert again.id == first.id
    assert again.choices[0].text == first.choices[0].text
    other = client.completions.create(
        model=stack.model_name,
        prompt=PROMPTS[1],
        max_tokens=MAX_TOKENS,
        temperature=0.8,
        extra_headers={"X-Request-Id": "test-retry-other-key"},
    )
    assert other.id != first.id


def test_a_retry_after_a_dropped_stream_reattaches_to_the_running_sequence(stack: Stack):
    client = stack.client()
    fields = dict(model=stack.model_name, prompt=LONG_PROMPT, max_tokens=200, temperature=0)
    key = {"Idempotency-Key": "test-retry-after-disconnect"}
    stream = client.completions.create(**fields, stream=True, extra_headers=key)
    first_chunk = next(iter(stream))
    stream.close()  # the client goes away mid-answer
    retry = client.completions.create(**fields, extra_headers=key)
    assert retry.id == first_chunk.id
    assert retry.choices[0].finish_reason == "length"
    assert retry.usage.completion_tokens == 200
    assert stack.sequence(seq_id_of(retry.id)).finish_reason == pb.FINISH_REASON_MAX_LENGTH
    assert retry.choices[0].text == client.completions.create(**fields).choices[0].text


def test_a_keyed_sequence_nobody_retries_is_cancelled_after_the_grace_period(stack: Stack):
    stream = stack.client().completions.create(
        model=stack.model_name,
        prompt=LONG_PROMPT,
        max_tokens=3500,
        temperature=0,
        stream=True,
        extra_headers={"Idempotency-Key": "test-nobody-retries"},
    )
    seq_id = seq_id_of(next(iter(stream)).id)
    stream.close()
    info = wait_until(
        lambda seq_id=seq_id: stack.sequence(seq_id),
        f"seq_id {seq_id} to be cancelled",
        REATTACH_GRACE_SECONDS + 30,
        done=lambda i: i.state == pb.SEQUENCE_STATE_FINISHED,
    )
    assert info.finish_reason == pb.FINISH_REASON_CANCELLED


def test_a_client_that_disconnects_from_a_stream_cancels_its_sequence(stack: Stack):
    stream = stack.client().completions.create(
        model=stack.model_name, prompt=LONG_PROMPT, max_tokens=3500, temperature=0, stream=True
    )
    seq_id = seq_id_of(next(iter(stream)).id)
    stream.close()
    info = wait_until(
        lambda seq_id=seq_id: stack.sequence(seq_id),
        f"seq_id {seq_id} to be cancelled",
        30,
        done=lambda i: i.state == pb.SEQUENCE_STATE_FINISHED,
    )
    assert info.finish_reason == pb.FINISH_REASON_CANCELLED
    assert info.generated_tokens < 3500


def test_a_client_that_times_out_on_a_plain_request_cancels_its_sequence(stack: Stack):
    cancelled = 'lattice_scheduler_finished_total{reason="cancelled"}'
    disconnects = 'lattice_gateway_client_disconnects_total{endpoint="/v1/completions"}'
    before = metric_value(stack.scheduler_metrics_url, cancelled)
    disconnects_before = metric_value(f"{stack.base_url}/metrics", disconnects)
    with pytest.raises(openai.APITimeoutError):
        stack.client(timeout=1.0).completions.create(
            model=stack.model_name, prompt=LONG_PROMPT, max_tokens=3500, temperature=0
        )
    wait_until(
        lambda: metric_value(stack.scheduler_metrics_url, cancelled) >= before + 1,
        "the scheduler to count one more cancelled sequence",
        30,
    )
    assert metric_value(f"{stack.base_url}/metrics", disconnects) == disconnects_before + 1
    # Nothing runs on: the 3500-token sequence would keep the worker busy for a long while.
    wait_until(
        lambda: stack.stub.GetStatus(pb.GetStatusRequest(), timeout=10).num_assigned,
        "no sequence to be assigned",
        30,
        done=lambda num_assigned: num_assigned == 0,
    )


def test_a_full_queue_is_a_429_naming_resource_exhausted(idle_stack: Stack):
    client = idle_stack.client()
    holder = client.completions.create(
        model="tiny", prompt="waits in the queue", max_tokens=4, stream=True
    )  # answers once queued
    try:
        assert idle_stack.stub.GetStatus(pb.GetStatusRequest(), timeout=10).queue_depth == 1
        with pytest.raises(openai.RateLimitError) as raised:
            client.completions.create(model="tiny", prompt="no room", max_tokens=4)
        assert "RESOURCE_EXHAUSTED" in raised.value.body["message"]
    finally:
        holder.close()
    wait_until(
        lambda: idle_stack.stub.GetStatus(pb.GetStatusRequest(), timeout=10).queue_depth == 0,
        "the holder's sequence to be cancelled when it left",
        30,
    )


def test_an_unreachable_scheduler_is_a_503_on_requests_and_on_health(checkpoint, tmp_path):
    with socket.socket() as sock:  # a port that nothing listens on
        sock.bind((LOOPBACK, 0))
        dead_target = f"{LOOPBACK}:{sock.getsockname()[1]}"
    gateway = spawn(
        "gateway", gateway_argv(dead_target, checkpoint.path), tmp_path, GATEWAY_LISTENING
    )
    try:
        base_url = f"http://{LOOPBACK}:{gateway.ports[0]}"
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"{base_url}/health", timeout=10)
        assert health.value.code == 503
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as raised:
            client.completions.create(model=checkpoint.path.name, prompt="hi", max_tokens=4)
        assert raised.value.status_code == 503
        assert f"cannot reach the scheduler at {dead_target}" in raised.value.body["message"]
    finally:
        gateway.stop()
