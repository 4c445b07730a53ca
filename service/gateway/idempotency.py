"""Idempotency keys, scoped by principal and bound to the request they first came with.

The scheduler's `request_id` for a keyed request is a digest of the principal, the
client's key and the request's fingerprint (everything the gateway submits, but the id),
so that
- one principal's key never reaches another principal's sequence (alice's answer is not
  mallory's, whatever key mallory sends), and
- another body under a known key never gets the first body's answer, even from a gateway
  that forgot the key (restarted, or one of several).
On top of that the gateway remembers, for `ttl_seconds` and up to `max_keys` keys, which
fingerprint each (principal, key) came with: the same key with another body is a 422,
whenever it comes, in flight or long finished.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace

from service.gateway.errors import GatewayError
from service.gateway.generations import Attempt

# How long a key stays bound to its body (OpenAI and Stripe keep keys for 24 hours), and
# how many keys are remembered at most (the oldest are forgotten first).
DEFAULT_TTL_SECONDS = 24 * 3600.0
DEFAULT_MAX_KEYS = 100_000
# Prefix of the scheduler request_ids the gateway derives (the version of the scheme).
REQUEST_ID_PREFIX = "gw1-"


def fingerprint(attempt: Attempt) -> str:
    """A digest of what `attempt` submits, but its request_id (and the token it uses)."""
    generation = replace(attempt.generation, request_id="", scheduler_token=None)
    return hashlib.sha256(repr((generation, attempt.stop)).encode()).hexdigest()


def scheduler_request_id(principal: str, key: str, body_fingerprint: str) -> str:
    """The scheduler's request_id for `key` of `principal` with this body (68 ASCII bytes)."""
    digest = hashlib.sha256(
        "\x00".join((principal, key, body_fingerprint)).encode("utf-8", "surrogateescape")
    ).hexdigest()
    return REQUEST_ID_PREFIX + digest


class IdempotencyKeys:
    """Which body each (principal, key) came with, for a while; see the module docstring."""

    def __init__(
        self,
        ttl_seconds: float = DEFAULT_TTL_SECONDS,
        max_keys: int = DEFAULT_MAX_KEYS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ttl_seconds = ttl_seconds
        self._max_keys = max_keys
        self._clock = clock
        # (principal, key) -> (fingerprint, when it was first seen); oldest first.
        self._bound: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._bound)

    def keyed(self, attempts: list[Attempt], principal: str, key: str) -> list[Attempt]:
        """`attempts` (a request's choices) with the scheduler request_ids of `key`; a 422
        if the key came with another body before."""
        if not key:
            return attempts
        body = hashlib.sha256(" ".join(fingerprint(a) for a in attempts).encode()).hexdigest()
        now = self._clock()
        self._forget_expired(now)
        known = self._bound.get((principal, key))
        if known is not None and known[0] != body:
            raise GatewayError(
                422,
                "this Idempotency-Key was used with a different request body; a retry "
                "must send the same body (or use a new key)",
                param="Idempotency-Key",
                code="idempotency_key_reused",
                retryable=False,
            )
        if known is None:
            self._bound[(principal, key)] = (body, now)
            while len(self._bound) > self._max_keys:
                self._bound.popitem(last=False)
        return [
            replace(
                attempt,
                generation=replace(
                    attempt.generation,
                    request_id=scheduler_request_id(principal, key, f"{body}:{index}"),
                ),
            )
            for index, attempt in enumerate(attempts)
        ]

    def _forget_expired(self, now: float) -> None:
        while self._bound:
            _, (_, seen_at) = next(iter(self._bound.items()))
            if now - seen_at < self._ttl_seconds:
                return
            self._bound.popitem(last=False)
