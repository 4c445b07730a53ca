"""Chat templates: the checkpoint's Jinja template, rendered as transformers renders it.

The environment matches what chat templates are written against (transformers'
`apply_chat_template`): sandboxed, `trim_blocks`/`lstrip_blocks`, the `loopcontrols`
extension, a `tojson` that keeps non-ASCII text, `raise_exception` and `strftime_now`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template refused the messages (its own raise_exception), or failed to render."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class ChatTemplate:
    """One compiled template; `render` is safe to call from many requests at once."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(source)
        self._special_tokens = dict(special_tokens)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for `messages`; ChatTemplateError with the template's reason."""
        context = {
            "tools": None,
            "documents": None,
            **self._special_tokens,
            **dict(extra or {}),
            "messages": list(messages),
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(**context)
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, ValueError, KeyError) as err:
            raise ChatTemplateError(f"the chat template failed: {err}") from None
