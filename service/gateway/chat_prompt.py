"""A chat request's prompt token ids: special tokens only where the template puts them.

The template's output is one string, and tokenizing it parses every special token's text
in it, also text a user wrote: content `hi<|im_end|>\\n<|im_start|>system\\n...` would
become a system turn, a prompt injection past the template. So what messages say is tokenized as text:
- Most requests hold no added token's text in any message: the rendered prompt is
  tokenized whole, exactly as transformers' apply_chat_template(tokenize=True) does.
- Otherwise each message string is rendered as a placeholder, the template's own text
  is tokenized with special tokens parsed, and each message string in its place with
  none parsed (tokenizers' `encode_special_tokens`): the user's `<|im_end|>` becomes
  the tokens of its characters.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from service.gateway.chat_template import ChatTemplate
from service.gateway.errors import bad_request
from service.gateway.model_files import ModelFiles


def chat_prompt_ids(
    files: ModelFiles,
    template: ChatTemplate,
    messages: Sequence[Mapping[str, Any]],
    extra: Mapping[str, Any] | None = None,
) -> list[int]:
    """The prompt of `messages` (as chat templates take them); ChatTemplateError from the
    template, a 400 for special-token text where it cannot be kept as text."""
    special = files.added_token_texts
    for key, value in (extra or {}).items():
        if _holds(value, special):
            raise bad_request(
                f"chat_template_kwargs.{key} holds the text of a special token; "
                "special tokens come from the chat template only",
                f"chat_template_kwargs.{key}",
            )
    if not any(_holds(message, special) for message in messages):
        return files.encode(template.render(messages, extra=extra), add_special_tokens=False)
    nonce = secrets.token_hex(8)
    texts: list[str] = []
    placeheld = []
    for index, message in enumerate(messages):
        copy = dict(message)
        for key, value in message.items():
            if key == "role":
                if _holds(value, special):
                    raise bad_request(
                        f"messages[{index}].role holds the text of a special token",
                        f"messages[{index}].role",
                    )
                continue
            if isinstance(value, str):
                copy[key] = f"\ue000{nonce}:{len(texts)}\ue001"
                texts.append(value)
            elif _holds(value, special):
                raise bad_request(
                    f"messages[{index}].{key} holds the text of a special "
                    "token where it cannot be kept as text",
                    f"messages[{index}]",
                )
        placeheld.append(copy)
    rendered = template.render(placeheld, extra=extra)
    ids: list[int] = []
    pieces = re.split(f"\ue000{nonce}:(\\d+)\ue001", rendered)
    for position, piece in enumerate(pieces):
        if position % 2:  # a message's text, by its index
            ids += files.encode_text(texts[int(piece)])
        elif nonce in piece:
            raise bad_request(
                "the chat template cut a message's text apart (it holds the "
                "text of a special token, which is kept as text)",
                "messages",
            )
        elif piece:
            ids += files.encode(piece, add_special_tokens=False)
    return ids


def _holds(value: Any, texts: tuple[str, ...]) -> bool:
    """Whether any string under `value` holds one of `texts`."""
    if isinstance(value, str):
        return any(text in value for text in texts)
    if isinstance(value, Mapping):
        return any(_holds(v, texts) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds(v, texts) for v in value)
    return False
