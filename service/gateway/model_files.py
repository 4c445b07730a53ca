"""What the gateway reads from a model directory: tokenizer, chat template, generation defaults.

Files, as transformers writes them: `tokenizer.json` (required), `tokenizer_config.json`
(special tokens, `chat_template`), `chat_template.jinja` (newer checkpoints keep the
template there), `generation_config.json` (EOS ids and sampling defaults) and
`config.json` (EOS ids, `max_position_embeddings`). No weights are read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import ConfigError
from service.gateway.chat_template import ChatTemplate

# Used when neither config.json nor the flag says how long a sequence may be: the
# scheduler's default --max-seq-len.
DEFAULT_MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class SamplingDefaults:
    """generation_config.json's sampling values; None where it gives none."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None


class ModelFiles:
    """The tokenizer and the settings of one checkpoint directory."""

    def __init__(self, model_dir: str | Path) -> None:
        """Read `model_dir`; ConfigError naming the file when one is missing or malformed."""
        from tokenizers import Tokenizer

        self.model_dir = Path(model_dir)
        tokenizer_file = self.model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ConfigError(
                f"--model {model_dir}: no tokenizer.json there (the gateway "
                f"tokenizes with the checkpoint's own tokenizer)"
            )
        try:
            self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as err:  # noqa: BLE001 - tokenizers raises plain Exception for a bad file
            raise ConfigError(f"{tokenizer_file}: not a tokenizers file ({err})") from None
        # The same tokenizer, reading added tokens' text as plain text (its setting is
        # per instance: two instances, so that no call changes it under another).
        self._text_tokenizer = Tokenizer.from_str(self.tokenizer.to_str())
        self._text_tokenizer.encode_special_tokens = True
        # Texts the tokenizer turns into added tokens (special ones among them).
        self.added_token_texts = tuple(
            token.content
            for token in self.tokenizer.get_added_tokens_decoder().values()
            if token.content
        )
        tokenizer_config = _read_json(self.model_dir / "tokenizer_config.json")
        generation_config = _read_json(self.model_dir / "generation_config.json")
        config = _read_json(self.model_dir / "config.json")
        text_config = config.get("text_config") or {}
        self.special_tokens = {
            name: token
            for name in ("bos_token", "eos_token", "pad_token", "unk_token")
            if (token := _token_text(tokenizer_config.get(name)))
        }
        self.chat_template = self._chat_template(tokenizer_config)
        self.eos_token_ids = self._eos_ids(generation_config, text_config, config)
        self.sampling_defaults = SamplingDefaults(
            temperature=_number(generation_config.get("temperature")),
            top_p=_number(generation_config.get("top_p")),
            top_k=_integer(generation_config.get("top_k")),
        )
        self.max_position_embeddings = _integer(
            text_config.get("max_position_embeddings", config.get("max_position_embeddings"))
        )

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    # Both through encode_batch: tokenizers' encode holds the GIL for the whole call (a
    # long prompt stalled every other request), encode_batch releases it; the ids are
    # the same.
    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of `text`, added tokens' text in it parsed as those tokens."""
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids of `text` as plain text: `<|im_end|>` in it is its characters."""
        return self._text_tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, token_ids: list[int]) -> str:
        """Text of `token_ids`, special tokens left out (what transformers' decode gives with
        skip_special_tokens=True)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _chat_template(self, tokenizer_config: dict[str, Any]) -> ChatTemplate | None:
        source = tokenizer_config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}]
            named = {item.get("name"): item.get("template") for item in source}
            source = named.get("default") or next(iter(named.values()), None)
        jinja_file = self.model_dir / "chat_template.jinja"
        if not source and jinja_file.is_file():
            source = jinja_file.read_text()
        if not source:
            return None
        try:
            return ChatTemplate(source, self.special_tokens)
        except Exception as err:  # noqa: BLE001 - jinja2 syntax errors and whatever a template raises
            raise ConfigError(
                f"{self.model_dir}: the chat template does not compile: {err}"
            ) from None

    def _eos_ids(self, *sources: dict[str, Any]) -> tuple[int, ...]:
        """EOS ids from generation_config.json, config.json (or its text_config) and the
        tokenizer's eos_token: the union, as generation stops at any of them."""
        ids: list[int] = []
        for source in sources:
            value = source.get("eos_token_id")
            for token_id in value if isinstance(value, list) else [value]:
                if isinstance(token_id, int) and token_id not in ids:
                    ids.append(token_id)
        eos_text = self.special_tokens.get("eos_token")
        token_id = self.tokenizer.token_to_id(eos_text) if eos_text else None
        if token_id is not None and token_id not in ids:
            ids.append(token_id)
        return tuple(ids)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return value


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _integer(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
