"""`n` up to 8: n sequences, one seed each, one response; streamed,
every choice's chunks by index, one usage and one [DONE]."""

from __future__ import annotations

import json

import pytest

from .inprocess import MODEL, InProcessGateway, write_model


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    started = InProcessGateway(write_model(tmp_path_factory.mktemp("choices-model")))
    yield started
    started.stop()


def new_requests(gateway: InProcessGateway, before: int):
    return gateway.scheduler.requests[before:]


def test_n_choices_are_n_sequences_with_seeds_of_their_own_in_one_response(gateway):
    before = len(gateway.scheduler.requests)
    answer = gateway.complete(n=3, seed=7, max_tokens=4)
    assert answer.status == 200, answer.text
    assert [c["index"] for c in answer.body["choices"]] == [0, 1, 2]
    requests = new_requests(gateway, before)
    assert [r.seed for r in requests] == [7, 8, 9]
    assert len({r.prompt_token_ids for r in requests}) == 1
    assert answer.body["usage"]["completion_tokens"] == 3 * 4
    assert answer.body["usage"]["prompt_tokens"] == len(requests[0].prompt_token_ids)


def test_chat_choices_each_carry_a_message(gateway):
    answer = gateway.chat([{"role": "user", "content": "hi"}], n=2)
    assert answer.status == 200, answer.text
    assert [(c["index"], c["message"]["role"]) for c in answer.body["choices"]] == [
        (0, "assistant"),
        (1, "assistant"),
    ]


def test_streamed_choices_come_by_index_with_one_usage_and_one_done(gateway):
    answer = gateway.request(
        "POST",
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert answer.status == 200
    events = [line[len("data: ") :] for line in answer.text.split("\n\n") if line]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    finishes = {
        c["choices"][0]["index"]: c["choices"][0]["finish_reason"]
        for c in chunks
        if c["choices"] and c["choices"][0]["finish_reason"]
    }
    assert finishes == {0: "length", 1: "length"}
    (usage,) = [c["usage"] for c in chunks if c.get("usage")]
    assert usage["completion_tokens"] == 2 * 4


def test_keyed_choices_reattach_to_their_own_sequences(gateway):
    key = {"idempotency-key": "n-key"}
    first = gateway.complete(headers=key, n=2)
    before = len(gateway.scheduler.requests)
    again = gateway.complete(headers=key, n=2)
    assert (first.status, again.status) == (200, 200)
    retried = new_requests(gateway, before)
    assert len({r.request_id for r in retried}) == 2, "one scheduler request_id per choice"
    assert again.body["id"] == first.body["id"]
    assert gateway.complete(headers=key, n=3).status == 422, "another n is another body"


def test_more_than_eight_choices_is_a_400_naming_n(gateway):
    answer = gateway.complete(n=9)
    assert (answer.status, answer.body["error"]["param"]) == (400, "n")
