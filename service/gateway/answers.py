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
from service.gateway.scheduler_link import FinishReason, GenerationRequest

# OpenAI's documented default for /v1/completions; chat completions default to the rest
# of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# The scheduler's limit on request_id and tenant (service/server/convert.py MAX_STRING_BYTES).
MAX_NAME_BYTES = 256


@dataclass(frozen=True)
class Plan:
    attempt: Attempt
    num_prompt_tokens: int


@dataclass(frozen=True)
class Delta:
    """New text of the answer."""

    text: str


@dataclass(frozen=True)
class Finish:
    """The answer ended: OpenAI's finish_reason and the tokens it took."""

    reason: str  # "stop" or "length"
    num_completion_tokens: int


def plan(body: SamplingFields, prompt_token_ids: list[int], *, max_new_tokens: int | None,
         default_max_tokens: int | None, files: ModelFiles, max_model_len: int,
         request_id: str, principal: Principal = ANONYMOUS, choice: int = 0) -> Plan:
    """The sequence to submit for `body` from `principal`; 400 when it cannot fit in
    `max_model_len`. `request_id` is the client's idempotency key (it seeds sampling);
    service/gateway/idempotency.py turns it into the scheduler's request_id. `choice` is
    the index among the request's `n` choices: each samples with a seed of its own."""
    body.check_supported()
    stop = body.stop_strings()
    num_prompt = len(prompt_token_ids)
    if num_prompt >= max_model_len:
        raise bad_request(f"the prompt is {num_prompt} tokens; this model takes at most "
                          f"{max_model_len} tokens, prompt and completion together",
                          "messages" if default_max_tokens is None else "prompt")
    room = max_model_len - num_prompt
    if max_new_tokens is None:
        max_new_tokens = min(default_max_tokens or room, room)
    elif max_new_tokens > room:
        raise bad_request(f"max_tokens is {max_new_tokens} but the prompt is {num_prompt} "
                          f"tokens, and this model takes at most {max_model_len} in all: "
                          f"ask for at most {room}", "max_tokens")
    if len(request_id.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
        raise bad_request(f"the Idempotency-Key / X-Request-Id header is longer than "
                          f"{MAX_NAME_BYTES} bytes", "Idempotency-Key")
    if body.user and len(body.user.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise bad_request(f"user is longer than {MAX_NAME_BYTES} bytes", "user")
    if body.user and "\x00" in body.user:
        raise bad_request("user must not contain NUL (it names the scheduler tenant)", "user")
    bad_stop = [t for t in body.stop_token_ids or () if t >= files.vocab_size]
    if bad_stop:
        raise bad_request(f"stop token id {bad_stop[0]} is outside the vocabulary "
                          f"(0..{files.vocab_size - 1})", "stop_token_ids")
    defaults = files.sampling_defaults
    temperature = _first(body.temperature, defaults.temperature, 1.0)
    top_p = _first(body.top_p, defaults.top_p, 0.0)
    if body.top_p == 0:  # nucleus of mass 0: the most likely token alone (the wire's 0 is "off")
        temperature, top_p = 0.0, 0.0
    top_k = max(0, _first(body.top_k, defaults.top_k, 0))
    stop_token_ids = tuple(dict.fromkeys([*(body.stop_token_ids or ()), *files.eos_token_ids]))
    generation = GenerationRequest(
        prompt_token_ids=tuple(prompt_token_ids), max_new_tokens=max_new_tokens,
        temperature=temperature, top_p=0.0 if top_p >= 1.0 else top_p, top_k=top_k,
        seed=_seed(body.seed, request_id, choice), stop_token_ids=stop_token_ids,
        tenant=principal.tenant_for(body.user), priority=body.priority or 0,
        request_id=request_id, principal=principal.name,
        scheduler_token=principal.scheduler_token)
    return Plan(Attempt(generation, stop), num_prompt)


def _first(*values):
    return next(v for v in values if v is not None)


def _seed(seed: int | None, request_id: str, choice: int = 0) -> int:
    """The client's seed (any integer, folded into 64 bits; choice i of `n` gets seed + i);
    without one, a seed of the idempotency key (retries sample alike), else a fresh random
    one."""
    if seed is not None:
        return (seed + choice) % 2 ** 64
    if request_id:
        key = request_id if choice == 0 else f"{request_id}#{choice}"
        return int.from_bytes(hashlib.sha256(key.encode("utf-8", "surrogateescape")
                                             ).digest()[:8], "big")
    return secrets.randbits(63)


async def text_events(generations: Generations, generation: Generation, files: ModelFiles,
                      stop: tuple[str, ...]) -> AsyncIterator[Delta | Finish]:
    """The answer's text as it comes, then its Finish; GatewayError if it cannot finish."""
    assembler = TextAssembler(files.decode, stop)
    async for token_ids in generation.follow():
        text = assembler.add(token_ids)
        if text:
            yield Delta(text)
        if assembler.stopped:
            generations.stop(generation)
            yield Finish("stop", assembler.num_tokens)
            return
    text = assembler.finish()
    if text:
        yield Delta(text)
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
        raise GatewayError(409, f"seq_id {generation.seq_id} was cancelled on the scheduler "
                                f"before it finished (by an operator, or after its client "
                                f"left); send the request again with a new Idempotency-Key",
                           code="cancelled", retryable=False)
    if reason == FinishReason.FAILED:
        detail = generation.error_message or "no reason given"
        raise GatewayError(500, f"seq_id {generation.seq_id} failed on its worker: {detail}",
                           code="failed")
    raise GatewayError(502, f"seq_id {generation.seq_id} ended with {reason}")
