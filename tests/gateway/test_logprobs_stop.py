"""Under `stop`, an answer's logprobs cover exactly its text: no token past the stop
string, the token it ends inside cut there; plain and streamed, completions and chat."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.gateway.detokenize import TextAssembler
from service.gateway.model_files import ModelFiles
from service.gateway.scheduler_link import FinishReason, TokenEvent, TokenLogprob

from .inprocess import MODEL, FakeScheduler, InProcessGateway, write_model

ANSWER_TEXT = "The queue, then the worker; done. More after it."


class _OneByOne:
    """A stream of one token per event, each with a logprob."""

    def __init__(self, seq_id: int, token_ids: tuple[int, ...]) -> None:
        self.seq_id = seq_id
        self._events = [
            TokenEvent((t,), logprobs=(TokenLogprob(-0.5 - i / 100, (t,), (-0.5 - i / 100,)),))
            for i, t in enumerate(token_ids)
        ] + [TokenEvent((), FinishReason.MAX_LENGTH)]

    async def next(self) -> TokenEvent:
        await asyncio.sleep(0)
        return self._events.pop(0)

    def cancel(self) -> None:
        pass


@dataclass
class LogprobScheduler(FakeScheduler):
    streams: list = field(default_factory=list)

    async def generate(self, request):
        await super().generate(request)
        return _OneByOne(len(self.requests), self.answer[: request.max_new_tokens])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("stop-logprobs-model"))


@pytest.fixture(scope="module")
def gateway(model_dir):
    files = ModelFiles(model_dir)
    answer = tuple(files.encode(ANSWER_TEXT, add_special_tokens=False))
    started = InProcessGateway(model_dir, LogprobScheduler(answer=answer))
    yield started
    started.stop()


def _streamed(answer) -> list[dict]:
    events = [line[len("data: ") :] for line in answer.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e)["choices"][0] for e in events[:-1] if json.loads(e)["choices"]]


def _completion(gateway, stop, stream: bool):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 64, "logprobs": 2, "stop": stop}
    answer = gateway.request("POST", "/v1/completions", {**body, "stream": stream})
    assert answer.status == 200, answer.text
    if not stream:
        choice = answer.body["choices"][0]
        return choice["text"], choice["logprobs"], choice["finish_reason"]
    choices = _streamed(answer)
    blocks = [c["logprobs"] for c in choices if c.get("logprobs")]
    logprobs = {k: [v for b in blocks for v in b[k]] for k in blocks[0]} if blocks else {}
    finish = [c["finish_reason"] for c in choices if c.get("finish_reason")]
    return "".join(c["text"] for c in choices), logprobs, finish[-1]


def _chat(gateway, stop, stream: bool):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 64,
        "logprobs": True,
        "top_logprobs": 1,
        "stop": stop,
        "stream": stream,
    }
    answer = gateway.request("POST", "/v1/chat/completions", body)
    assert answer.status == 200, answer.text
    if not stream:
        choice = answer.body["choices"][0]
        return choice["message"]["content"], choice["logprobs"]["content"]
    choices = _streamed(answer)
    text = "".join(c["delta"].get("content") or "" for c in choices)
    content = [item for c in choices if c.get("logprobs") for item in c["logprobs"]["content"]]
    return text, content


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("stop", ["; done", "worker", "e", "e, th", "ueu"])
def test_completion_logprobs_cover_exactly_the_text_returned_under_stop(gateway, stop, stream):
    """Regression (outside probe): the logprobs ran past the text, with the token that
    completed the stop string (text_offset beyond the text, joined tokens not the text)."""
    text, logprobs, finish = _completion(gateway, [stop], stream)
    assert finish == "stop" and text == ANSWER_TEXT[: ANSWER_TEXT.index(stop)]
    assert "".join(logprobs["tokens"]) == text
    assert all(offset < len(text) for offset in logprobs["text_offset"])
    assert len(logprobs["token_logprobs"]) == len(logprobs["tokens"])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("stop", ["; done", "worker", "e, th"])
def test_chat_logprobs_cover_exactly_the_text_returned_under_stop(gateway, stop, stream):
    text, content = _chat(gateway, [stop], stream)
    assert text == ANSWER_TEXT[: ANSWER_TEXT.index(stop)]
    assert "".join(item["token"] for item in content) == text
    assert all(bytes(item["bytes"]).decode() == item["token"] for item in content)


def test_without_a_stop_match_every_token_is_covered(gateway):
    text, logprobs, finish = _completion(gateway, ["not in it"], stream=True)
    assert finish == "length" and text == ANSWER_TEXT
    assert "".join(logprobs["tokens"]) == text


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_tokens_covered_join_to_the_text_handed_out_whatever_the_stop_and_pieces(
    model_dir, data
):
    """Property: tokens fed in any pieces, stop strings drawn from the text or not: the
    covered tokens (cut where `covered` says) join to the text handed out, at every step
    a prefix of it and at the end all of it."""
    files = ModelFiles(model_dir)
    text = data.draw(st.text(alphabet="ab c,.;\n", min_size=1, max_size=40))
    ids = files.encode(text, add_special_tokens=False)
    full = files.decode(ids)
    stops = data.draw(
        st.lists(
            st.one_of(
                st.text(alphabet="ab c,.;\n", min_size=1, max_size=4),
                st.integers(0, max(0, len(full) - 1)).flatmap(
                    lambda i: st.integers(i + 1, i + 4).map(lambda j: full[i:j])
                ),
            ),
            max_size=3,
        )
    )
    assembler = TextAssembler(files.decode, stops)
    out, at = "", 0
    while at < len(ids) and not assembler.stopped:
        step = data.draw(st.integers(1, 4))
        out += assembler.add(ids[at : at + step])
        at += step
        num, cut = assembler.covered()
        joined = "".join(files.decode([t]) for t in ids[:num])
        if cut is not None:
            joined = joined[: len(joined) - len(files.decode([ids[num - 1]])) + cut]
        assert out.startswith(joined)
    out += assembler.finish()
    num, cut = assembler.covered()
    pieces = [files.decode([t]) for t in ids[:num]]
    if cut is not None:
        pieces[-1] = pieces[-1][:cut]
    assert "".join(pieces) == out


def test_each_of_n_choices_carries_its_own_logprobs_as_docs_gateway_md_says(gateway):
    """docs/gateway.md said both that each of `n` choices gets its own logprobs and that
    `n` > 1 with logprobs is not supported; the server does the first."""
    from pathlib import Path

    answer = gateway.request(
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "hi", "max_tokens": 5, "logprobs": 1, "n": 2},
    )
    assert answer.status == 200, answer.text
    for choice in answer.body["choices"]:
        assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
    doc = (Path(__file__).parents[2] / "docs" / "gateway.md").read_text()
    assert "`n` > 1 with logprobs" not in doc.split("Not supported:")[1].split("\n\n")[0]
