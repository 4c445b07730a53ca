"""The gateway's demo load as conversations: each turn carries the conversation so far
(a fake client: no processes)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from service.gateway import demo_load
from service.gateway.demo_load import HttpLoadSpec, HttpResult


class FakeCompletions:
    def __init__(self):
        self.sent = []

    def create(self, *, model, messages, **options):
        self.sent.append([dict(m) for m in messages])
        answer = f"answer {len(self.sent)}"
        delta = SimpleNamespace(content=answer)
        yield SimpleNamespace(
            choices=[SimpleNamespace(delta=delta, finish_reason="stop")], usage=None
        )
        yield SimpleNamespace(choices=[], usage=SimpleNamespace(completion_tokens=2))


def test_each_turn_sends_the_conversation_so_far():
    pytest.importorskip("openai")
    completions = FakeCompletions()
    client = SimpleNamespace(chat=SimpleNamespace(completions=completions))
    results = [HttpResult() for _ in range(3)]
    demo_load._conversation(
        client, "m", ["first?", "second?", "third?"], 0, HttpLoadSpec(turns=3), results
    )
    assert [len(m) for m in completions.sent] == [1, 3, 5]
    assert completions.sent[2] == [
        {"role": "user", "content": "first?"},
        {"role": "assistant", "content": "answer 1"},
        {"role": "user", "content": "second?"},
        {"role": "assistant", "content": "answer 2"},
        {"role": "user", "content": "third?"},
    ]
    assert [r.text for r in results] == ["answer 1", "answer 2", "answer 3"]


def test_requests_are_split_into_conversations_the_last_one_shorter():
    assert HttpLoadSpec(num_requests=24, turns=4).num_conversations == 6
    assert HttpLoadSpec(num_requests=10, turns=4).num_conversations == 3
    assert HttpLoadSpec(num_requests=1, turns=4).num_conversations == 1
