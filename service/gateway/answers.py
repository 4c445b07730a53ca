"""From an OpenAI request to a sequence, and from its tokens back to text.

`plan` turns the checked body and the prompt's token ids into the `Attempt` to submit
(defaults from generation_config.json, the length limit, the seed); `text_events` follows
the sequence and yields text pieces, then how it finished.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass

from service.gateway.api_keys import ANONYMOUS, Principal
from service.gateway.detokenize import TextAssembler
from service.gateway.errors import GatewayError, bad_request
from service.gateway.generations import Attempt, Generation, Generations
from service.gateway.model_files import ModelFiles
from service.gateway.protocol import SamplingFields
from service.gateway.scheduler_link import FinishReason, GenerationRequest, TokenLogprob

# OpenAI's documented default for /v1/completions; chat completions default to the rest
# of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# The scheduler's limit on request_id and tenant (service/server/convert.py MAX_STRING_BYTES).
MAX_NAME_BYTES = 256


@dataclass(frozen=True)
class Plan:
    attempt: Attempt
    num_prompt_tokens: int
    # Alternatives per token's logprob in the answer; None: the answer has no logprobs.
    num_top_logprobs: int | None = None
    # Completions' echo: the prompt (text and logprobs) leads the answer.
    echo: bool = False
    # max_tokens 0 (with echo): one token is generated (the scheduler needs one) and dropped.
    discard_generated: bool = False


@dataclass(frozen=True)
class Delta:
    """New text of the answer, and (when asked for) the tokens taken since the last Delta
    with their logprobs (one per token, None when unknown)."""

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob | None, ...] = ()
    # Characters of the last token's text that are in the answer (None: all of it): a stop
    # string may end the answer inside a token.
    last_token_chars: int | None = None


@dataclass(frozen=True)
class Finish:
    """The answer ended: OpenAI's finish_reason and the tokens it took."""

    reason: str  # "stop" or "length"
    num_completion_tokens: int


def plan(
    body: SamplingFields,
    prompt_token_ids: list[int],
    *,
    max_new_tokens: int | None,
    default_max_tokens: int | None,
    files: ModelFiles,
    max_model_len: int,
    request_id: str,
    principal: Principal = ANONYMOUS,
    choice: int = 0,
) -> Plan:
    """The sequence to submit for `body` from `principal`; 400 when it cannot fit in
    `max_model_len`. `request_id` is the client's idempotency key (it seeds sampling);
    service/gateway/idempotency.py turns it into the scheduler's request_id. `choice` is
    the index among the request's `n` choices: each samples with a seed of its own."""
    body.check_supported()
    stop = body.stop_strings()
    num_prompt = len(prompt_token_ids)
    if num_prompt >= max_model_len:
        raise bad_request(
            f"the prompt is {num_prompt} tokens; this model takes at most "
            f"{max_model_len} tokens, prompt and completion together",
            "messages" if default_max_tokens is None else "prompt",
        )
    room = max_model_len - num_prompt
    discard_generated = max_new_tokens == 0  # checked: only with echo
    if discard_generated:
        max_new_tokens = 1
    if max_new_tokens is None:
        max_new_tokens = min(default_max_tokens or room, room)
    elif max_new_tokens > room:
        raise bad_request(
            f"max_tokens is {max_new_tokens} but the prompt is {num_prompt} "
            f"tokens, and this model takes at most {max_model_len} in all: "
            f"ask for at most {room}",
            "max_tokens",
        )
    if len(request_id.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
        raise bad_request(
            f"the Idempotency-Key / X-Request-Id header is longer than {MAX_NAME_BYTES} bytes",
            "Idempotency-Key",
        )
    if body.user and len(body.user.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise bad_request(f"user is longer than {MAX_NAME_BYTES} bytes", "user")
    if body.user and "\x00" in body.user:
        raise bad_request("user must not contain NUL (it names the scheduler tenant)", "user")
    bad_stop = [t for t in body.stop_token_ids or () if t >= files.vocab_size]
    if bad_stop:
        raise bad_request(
            f"stop token id {bad_stop[0]} is outside the vocabulary (0..{files.vocab_size - 1})",
            "stop_token_ids",
        )
    defaults = files.sampling_defaults
    temperature = _first(body.temperature, defaults.temperature, 1.0)
    top_p = _first(body.top_p, defaults.top_p, 0.0)
    if body.top_p == 0:  # nucleus of mass 0: the most likely token alone (the wire's 0 is "off")
        temperature, top_p = 0.0, 0.0
    top_k = max(0, _first(body.top_k, defaults.top_k, 0))
    min_tokens = body.min_tokens or 0
    if min_tokens > max_new_tokens and not discard_generated:
        raise bad_request(
            f"min_tokens is {min_tokens}, more than max_tokens ({max_new_tokens})", "min_tokens"
        )
    # The model's EOS ids end a sequence as stop tokens (the scheduler knows no EOS of its
    # own); ignore_eos leaves them out, so only the client's stop_token_ids end it early.
    eos_ids = () if body.ignore_eos else files.eos_token_ids
    stop_token_ids = tuple(dict.fromkeys([*(body.stop_token_ids or ()), *eos_ids]))
    num_top, num_top_prompt = body.num_top_logprobs, body.num_top_prompt_logprobs
    generation = GenerationRequest(
        prompt_token_ids=tuple(prompt_token_ids),
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=0.0 if top_p >= 1.0 else top_p,
        top_k=top_k,
        seed=_seed(body.seed, request_id, choice),
        stop_token_ids=stop_token_ids,
        tenant=principal.tenant_for(body.user),
        priority=body.priority or 0,
        request_id=request_id,
        principal=principal.name,
        scheduler_token=principal.scheduler_token,
        # The scheduler's 0 means "no logprobs": ask for one alternative at least, and
        # show the client the number it asked for.
        logprobs=0 if num_top is None or discard_generated else max(1, num_top),
        prompt_logprobs=0 if num_top_prompt is None else max(1, num_top_prompt),
        ignore_eos=bool(body.ignore_eos),
        min_new_tokens=min(min_tokens, max_new_tokens),
    )
    return Plan(
        Attempt(generation, stop),
        num_prompt,
        num_top,
        num_top_prompt is not None,
        discard_generated,
    )


def _first(*values):
    return next(v for v in values if v is not None)


def _seed(seed: int | None, request_id: str, choice: int = 0) -> int:
    """The client's seed (any integer, folded into 64 bits; choice i of `n` gets seed + i);
    without one, a seed of the idempotency key (retries sample alike), else a fresh random
    one."""
    if seed is not None:
        return (seed + choice) % 2**64
    if request_id:
        key = request_id if choice == 0 else f"{request_id}#{choice}"
        return int.from_bytes(
            hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()[:8], "big"
        )
    return secrets.randbits(63)


async def text_events(
    generations: Generations,
    generation: Generation,
    files: ModelFiles,
    stop: tuple[str, ...],
    *,
    with_logprobs: bool = False,
    discard_generated: bool = False,
) -> AsyncIterator[Delta | Finish]:
    """The answer's text as it comes, then its Finish; GatewayError if it cannot finish.

    `with_logprobs`: every token taken comes in a Delta with its logprobs (a Delta may then
    carry tokens and no text yet). `discard_generated`: the tokens are not part of the
    answer (max_tokens 0), only the Finish comes."""
    if discard_generated:
        async for _ in generation.follow():
            pass
        _finish_reason(generation)  # raises for a cancelled or failed sequence
        yield Finish("length", 0)
        return
    assembler = TextAssembler(files.decode, stop)
    taken = 0  # tokens handed out in a Delta

    def delta(text: str) -> Delta:
        # With logprobs, the tokens that the text handed out so far covers, so that the
        # tokens of all Deltas joined are the answer's text (none past a stop string).
        nonlocal taken
        if not with_logprobs:
            return Delta(text)
        start, (taken, cut) = taken, assembler.covered()
        return Delta(
            text,
            tuple(generation.token_ids[start:taken]),
            tuple(generation.logprobs[start:taken]),
            cut,
        )

    async for token_ids in generation.follow():
        text = assembler.add(token_ids)
        if text or (with_logprobs and assembler.covered()[0] > taken):
            yield delta(text)
        if assembler.stopped:
            generations.stop(generation)
            yield Finish("stop", assembler.num_tokens)
            return
    text = assembler.finish()
    if text or (with_logprobs and assembler.covered()[0] > taken):
        yield delta(text)
    if assembler.stopped:  # the stop string was in text held back for a split character
        yield Finish("stop", assembler.num_tokens)
        return
    yield Finish(_finish_reason(generation), assembler.num_tokens)


def _finish_reason(generation: Generation) -> str:
    reason = generation.finish_reason
    if reason in (FinishReason.EOS, FinishReason.STOP):
        return "stop"
    if reason == FinishReason.MAX_LENGTH:
        return "length"
    if reason == FinishReason.CANCELLED:
        raise GatewayError(
            409,
            f"seq_id {generation.seq_id} was cancelled on the scheduler "
            f"before it finished (by an operator, or after its client "
            f"left); send the request again with a new Idempotency-Key",
            code="cancelled",
            retryable=False,
        )
    if reason == FinishReason.FAILED:
        detail = generation.error_message or "no reason given"
        raise GatewayError(
            500, f"seq_id {generation.seq_id} failed on its worker: {detail}", code="failed"
        )
    raise GatewayError(502, f"seq_id {generation.seq_id} ended with {reason}")
