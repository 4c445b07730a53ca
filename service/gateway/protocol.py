"""The OpenAI request bodies the gateway accepts (pydantic), and their checks.

Unknown fields are ignored, as OpenAI-compatible servers do; known fields that the gateway
cannot honour (n > 8, tools, penalties, ...) get a 400 that names them.
Extensions: `top_k`, `priority`, `stop_token_ids`, `chat_template_kwargs`, and vLLM's
`ignore_eos` and `min_tokens`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from service.gateway.errors import bad_request

MAX_STOP_STRINGS = 16
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions `logprobs`
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat `top_logprobs` (and the scheduler's)
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
UINT32_MAX = 2**32 - 1
# OpenAI's documented ranges.
MAX_TEMPERATURE = 2.0
# Choices (`n`) per request at most: each is a sequence of its own.
MAX_CHOICES = 8


class TextError(ValueError):
    """A string of the body that is not text UTF-8 can carry (a lone surrogate, which JSON
    can spell as an escape); `param` names where it is."""

    def __init__(self, param: str) -> None:
        super().__init__(
            f"{param} is not valid text: it holds a lone surrogate "
            "(U+D800-U+DFFF), which UTF-8 cannot encode"
        )
        self.param = param


def check_text(value: Any, path: str) -> None:
    """TextError naming the first string under `value` (keys too) with a lone surrogate."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise TextError(path) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(key, path)
            check_text(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_text(item, f"{path}[{index}]")


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    # 0 only with completions' echo (prompt log-probabilities, nothing generated).
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    # 0 is OpenAI's too: only the most likely token (greedy; answers.py).
    top_p: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1, le=UINT32_MAX)  # extension; -1 or 0 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    # Nullable where clients send null for "the default".
    n: int | None = Field(default=1, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # becomes the scheduler's tenant
    priority: int | None = Field(default=0, ge=INT32_MIN, le=INT32_MAX)  # extension; lower = sooner
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = False  # extension (vLLM): EOS does not end the answer
    min_tokens: int | None = Field(default=0, ge=0)  # extension (vLLM): no EOS/stop before

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        """Every string of the body, at any depth, is text (400 naming it otherwise)."""
        check_text(data, "")
        return data

    def stop_strings(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise bad_request(f"stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS}", "stop")
        return tuple(s for s in stop if s)

    def check_supported(self) -> None:
        """400 for a known parameter that the gateway would otherwise silently ignore."""
        if self.n is not None and self.n > MAX_CHOICES:
            raise bad_request(
                f"n={self.n}: this server returns at most {MAX_CHOICES} choices per request", "n"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise bad_request(f"{name} is not supported (only 0)", name)
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        if any(not 0 <= t <= UINT32_MAX for t in self.stop_token_ids or ()):
            raise bad_request(
                f"stop_token_ids must be token ids (0..{UINT32_MAX})", "stop_token_ids"
            )
        if self.max_tokens == 0 and not self.allows_zero_max_tokens:
            raise bad_request(
                "max_tokens must be at least 1 (0 only with echo on /v1/completions)", "max_tokens"
            )

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def allows_zero_max_tokens(self) -> bool:
        return False

    @property
    def num_top_logprobs(self) -> int | None:
        """Alternatives per generated token's log-probability; None: no logprobs."""
        return None

    @property
    def num_top_prompt_logprobs(self) -> int | None:
        """The same for the prompt's tokens (completions' echo); None: none."""
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    @property
    def allows_zero_max_tokens(self) -> bool:
        return bool(self.echo)

    @property
    def num_top_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_top_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise bad_request("best_of is not supported (only 1)", "best_of")

    def single_prompt(self) -> str | list[int]:
        """The one prompt: a string or token ids; 400 for a batch of several."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request(
                    f"prompt holds {len(prompt)} prompts; this server takes one per request",
                    "prompt",
                )
            prompt = prompt[0]
        if not prompt:
            raise bad_request("prompt is empty", "prompt")
        return prompt


# The roles OpenAI documents (less the deprecated "function"); "developer" is its newer
# name for "system", which is what chat templates know.
ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}; got {role[:40]!r}")
        return role

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: content as one string."""
        message = self.model_dump(exclude_none=True)
        if message["role"] == "developer":
            message["role"] = "system"
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(
                        f"a {self.role} message holds a content part of type "
                        f"{part.get('type')!r}; only text parts are supported",
                        "messages",
                    )
                texts.append(part["text"])
            message["content"] = "".join(texts)
        elif content is None:
            message["content"] = ""
        return message


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension, e.g. enable_thinking

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if self.tools:
            raise bad_request("tools are not supported by this server", "tools")
        if self.tool_choice not in (None, "none"):
            raise bad_request('tool_choice is not supported (only "none")', "tool_choice")
        if self.response_format and self.response_format.get("type") != "text":
            raise bad_request(
                'response_format is not supported (only {"type": "text"})', "response_format"
            )

    @property
    def num_top_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
