"""Every value a client can send is answered with a 400 naming it, never a 500:
out-of-range integers, lone surrogates (JSON spells them as escapes), NaN and
infinities, invalid JSON; and a property test over the request schema: no 500 for any
JSON the gateway can parse."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .inprocess import MODEL, InProcessGateway, write_model

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    started = InProcessGateway(write_model(tmp_path_factory.mktemp("values-model")))
    yield started
    started.stop()


def post(gateway: InProcessGateway, path: str, text: str):
    return gateway.request("POST", path, raw=text.encode())


def completion(**fields) -> str:
    return json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields})


def chat(messages, **fields) -> str:
    return json.dumps({"model": MODEL, "messages": messages, "max_tokens": 2, **fields})


@pytest.mark.parametrize(
    "path, text, param",
    [
        (COMPLETIONS, completion(top_k=2**40), "top_k"),
        (COMPLETIONS, completion(stop_token_ids=[2**40]), "stop_token_ids"),
        (COMPLETIONS, completion(stop_token_ids=[100_000]), "stop_token_ids"),  # past the vocab
        (COMPLETIONS, completion(prompt="hi\ud800"), "prompt"),
        (COMPLETIONS, completion(prompt=["ok", "\udfff"]), "prompt[1]"),
        (COMPLETIONS, completion(user="\ud800"), "user"),
        (COMPLETIONS, completion(user="a\x00b"), "user"),
        (COMPLETIONS, completion(stop=["\udc00"]), "stop[0]"),
        (COMPLETIONS, completion(model="\ud800"), "model"),
        (COMPLETIONS, completion(temperature=float("nan")), "temperature"),
        (COMPLETIONS, completion(temperature=float("inf")), "temperature"),
        (CHAT, chat([{"role": "user", "content": "\ud800"}]), "messages[0].content"),
        (CHAT, chat([{"role": "\ud800", "content": "hi"}]), "messages[0].role"),
        (
            CHAT,
            chat([{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]),
            "messages[0].content[0].text",
        ),
        (
            CHAT,
            chat([{"role": "user", "content": "hi"}], chat_template_kwargs={"x": "\ud800"}),
            "chat_template_kwargs.x",
        ),
    ],
)
def test_an_out_of_range_or_undecodable_value_is_a_400_naming_it(gateway, path, text, param):
    answer = post(gateway, path, text)
    assert answer.status == 400, answer.text
    assert answer.body["error"]["param"] == param, answer.body


def test_invalid_json_is_a_400_that_names_no_field(gateway):
    answer = post(gateway, COMPLETIONS, '{"model": "tiny", "prompt": ')
    assert answer.status == 400
    assert answer.body["error"]["param"] is None
    assert "not valid JSON" in answer.body["error"]["message"]


# ------------------------------------------------------------------ the property

ODD_STRINGS = st.sampled_from(
    ["\ud800", "\udfff", "a\x00b", "", " ", "<|im_end|>", "x" * 300, "tiny"]
)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text(max_size=20)
    | ODD_STRINGS
)
ANY_JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8) | ODD_STRINGS, inner, max_size=4)
    ),
    max_leaves=12,
)
SMALL_INTS = st.integers(-3, 70) | st.integers() | st.just(2**40)


def _field(typical) -> st.SearchStrategy:
    """Mostly a value of the field's type (so that requests get past the first check),
    sometimes any JSON at all."""
    return st.one_of(*[typical] * 7, ANY_JSON)


MESSAGE = st.fixed_dictionaries(
    {"role": _field(st.sampled_from(["user", "system", "assistant", "tool", "wizard"]))},
    optional={
        "content": _field(
            st.text(max_size=30)
            | ODD_STRINGS
            | st.lists(
                st.fixed_dictionaries(
                    {"type": _field(st.just("text")), "text": _field(st.text(max_size=10))}
                ),
                max_size=2,
            )
        ),
        "name": _field(st.text(max_size=5)),
    },
)
SHARED = {
    "model": _field(st.just(MODEL)),
    "max_tokens": _field(SMALL_INTS),
    "temperature": _field(st.floats()),
    "top_p": _field(st.floats()),
    "top_k": _field(SMALL_INTS),
    "seed": _field(st.integers()),
    "stop": _field(st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=20)),
    "stop_token_ids": _field(st.lists(SMALL_INTS, max_size=3)),
    "n": _field(SMALL_INTS),
    "stream": _field(st.booleans()),
    "stream_options": _field(st.fixed_dictionaries({"include_usage": _field(st.booleans())})),
    "user": _field(st.text(max_size=10) | ODD_STRINGS),
    "priority": _field(SMALL_INTS),
    "presence_penalty": _field(st.floats()),
    "frequency_penalty": _field(st.floats()),
    "logit_bias": _field(st.dictionaries(st.text(max_size=3), st.floats(), max_size=2)),
}
OPTIONAL = {k: v for k, v in SHARED.items() if k != "model"}
COMPLETION_BODY = st.fixed_dictionaries(
    {
        "model": SHARED["model"],
        "prompt": _field(
            st.text(max_size=40)
            | ODD_STRINGS
            | st.lists(SMALL_INTS, max_size=5)
            | st.lists(st.text(max_size=5) | ODD_STRINGS, max_size=3)
        ),
    },
    optional={
        **OPTIONAL,
        "echo": _field(st.booleans()),
        "logprobs": _field(SMALL_INTS),
        "best_of": _field(SMALL_INTS),
        "suffix": _field(st.text(max_size=3)),
    },
)
CHAT_BODY = st.fixed_dictionaries(
    {
        "model": SHARED["model"],
        "messages": _field(st.lists(MESSAGE, min_size=1, max_size=3)),
    },
    optional={
        **OPTIONAL,
        "max_completion_tokens": _field(SMALL_INTS),
        "logprobs": _field(st.booleans()),
        "top_logprobs": _field(SMALL_INTS),
        "tools": _field(st.lists(ANY_JSON, max_size=2)),
        "tool_choice": _field(st.sampled_from(["none", "auto"])),
        "response_format": _field(st.fixed_dictionaries({"type": _field(st.just("text"))})),
        "chat_template_kwargs": _field(st.dictionaries(st.text(max_size=8), ANY_JSON, max_size=3)),
    },
)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.sampled_from([COMPLETIONS, CHAT]).flatmap(
        lambda path: st.tuples(st.just(path), COMPLETION_BODY if path == COMPLETIONS else CHAT_BODY)
    )
)
def test_no_json_the_gateway_can_parse_gets_a_500(gateway, case):
    path, body = case
    answer = post(gateway, path, json.dumps(body))  # NaN, Infinity and \\ud800 included
    assert answer.status < 500, (answer.status, answer.text, body)
    assert "internal error" not in answer.text, (answer.text, body)
