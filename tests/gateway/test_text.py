"""Streamed text: split characters come out whole, pieces add up to the full decode, stop
strings are cut out; the chat template renders as transformers renders it."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.core import ConfigError
from service.gateway.chat_template import ChatTemplate, ChatTemplateError
from service.gateway.detokenize import IncrementalDetokenizer, StopStrings, TextAssembler
from service.gateway.model_files import ModelFiles
from worker_client.demo_model import CHAT_TEMPLATE, build_tokenizer, write_tokenizer_files


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer_files(path, build_tokenizer(512))
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [1, 0], "temperature": 0.7, "top_k": 20})
    )
    (path / "config.json").write_text(
        json.dumps({"eos_token_id": 1, "max_position_embeddings": 1024})
    )
    return path


@pytest.fixture(scope="module")
def files(model_dir) -> ModelFiles:
    return ModelFiles(model_dir)


def test_the_tokenizer_splits_multi_byte_characters_across_tokens(files):
    # The premise of the detokenizer tests: some single tokens hold part of a character.
    assert any(
        "\ufffd" in files.decode([t]) for t in files.encode("日本語 🚀", add_special_tokens=False)
    )


def test_a_character_split_across_tokens_comes_out_once_and_whole(files):
    text = "Café 日本語 🚀 naïve"
    detokenizer = IncrementalDetokenizer(files.decode)
    pieces = [detokenizer.add([t]) for t in files.encode(text, add_special_tokens=False)]
    pieces.append(detokenizer.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)
    assert "" in pieces  # some tokens completed no character


@settings(max_examples=200, deadline=None)
@given(token_ids=st.lists(st.integers(0, 511), max_size=40), cuts=st.lists(st.integers(1, 5)))
def test_pieces_always_add_up_to_the_decode_of_all_tokens(files, token_ids, cuts):
    detokenizer, pieces, start = IncrementalDetokenizer(files.decode), [], 0
    for size in cuts + [len(token_ids)]:
        pieces.append(detokenizer.add(token_ids[start : start + size]))
        start += size
    pieces.append(detokenizer.flush())
    assert "".join(pieces) == files.decode(token_ids)


def test_a_stop_string_split_across_pieces_is_cut_out_and_nothing_after_it_is_sent():
    stop = StopStrings(["o w", "never"])
    out = [stop.push(piece) for piece in ("Hel", "lo", " wo", "rld")]
    assert "".join(out) == "Hell"
    assert stop.matched == "o w"


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc ", max_size=30),
    cuts=st.lists(st.integers(0, 6)),
    stops=st.lists(st.text(alphabet="abc ", min_size=1, max_size=4), max_size=3),
)
def test_text_sent_is_a_prefix_of_the_text_and_never_holds_a_stop_string(text, cuts, stops):
    stop, out, start = StopStrings(stops), [], 0
    for size in cuts + [len(text)]:
        out.append(stop.push(text[start : start + size]))
        start += size
    if stop.matched is None:
        out.append(stop.flush())
    sent = "".join(out)
    assert not any(s in sent for s in stops)
    if stop.matched is None:
        assert sent == text
    else:
        assert text.startswith(sent + stop.matched)


def test_the_assembler_counts_tokens_up_to_the_one_that_completed_a_stop_string(files):
    ids = files.encode("Hello world, the queue", add_special_tokens=False)
    assembler = TextAssembler(files.decode, ["world"])
    text = assembler.add(ids) + assembler.finish()
    assert text == "Hello "
    assert assembler.stopped
    covered = next(n for n in range(1, len(ids) + 1) if "world" in files.decode(ids[:n]))
    assert assembler.num_tokens == covered


def test_model_files_read_eos_ids_defaults_and_the_chat_template(files):
    assert files.eos_token_ids == (1, 0)  # generation_config first, then the rest, once each
    assert (files.sampling_defaults.temperature, files.sampling_defaults.top_k) == (0.7, 20)
    assert files.max_position_embeddings == 1024
    rendered = files.chat_template.render([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_the_chat_template_renders_as_transformers_renders_it(model_dir, files):
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Grüße, 世界"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Again"},
    ]
    for add_generation_prompt in (True, False):
        assert files.chat_template.render(
            messages, add_generation_prompt=add_generation_prompt
        ) == tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )


def test_a_template_may_refuse_messages_with_raise_exception_and_use_tojson():
    template = ChatTemplate(
        "{% for m in messages %}{% if m.role not in ['user'] %}"
        "{{ raise_exception('only user messages, got ' + m.role) }}{% endif %}"
        "{{ m.content | tojson }}{% endfor %}",
        {},
    )
    assert template.render([{"role": "user", "content": "日本"}]) == '"日本"'
    with pytest.raises(ChatTemplateError, match="only user messages, got tool"):
        template.render([{"role": "tool", "content": "x"}])


def test_chat_template_jinja_file_is_used_when_tokenizer_config_has_none(model_dir, tmp_path):
    for name in ("tokenizer.json",):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (tmp_path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    assert ModelFiles(tmp_path).chat_template is not None


def test_a_model_dir_without_tokenizer_json_is_a_config_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        ModelFiles(tmp_path)
