"""Whether a sequence's prefill runs on a prefill worker and its decode is handed off to a
decode worker, or both stay on one worker (docs/disaggregation.md, "The decision rule").

A handoff moves a sequence's attention KV (growing with its tokens) and its GDN states
(the same size whatever the prompt's length) from one worker to another. It pays when the
prefill it takes off a decode worker would have delayed many decodes there, and the
transfer is short beside that: a short or mostly cached prompt stays where it is.

Pure: reads what it is handed, returns a choice; the caller places and applies.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from service.core.types import WorkerRole


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What one sequence's state weighs on a worker, from the model's shapes."""

    attention_layers: int
    # K and V of one token in one attention layer: 2 x kv_heads x head_dim x dtype bytes.
    kv_bytes_per_token: int
    gdn_layers: int = 0
    # One GDN layer's recurrent state plus its convolution state, per sequence.
    gdn_state_bytes: int = 0

    def handoff_bytes(self, num_tokens: int) -> int:
        """Bytes a handoff of a sequence holding `num_tokens` tokens moves."""
        return (
            self.attention_layers * num_tokens * self.kv_bytes_per_token
            + self.gdn_layers * self.gdn_state_bytes
        )

    def gdn_share(self, num_tokens: int) -> float:
        """The constant GDN part of handoff_bytes(num_tokens), 0-1."""
        total = self.handoff_bytes(num_tokens)
        return self.gdn_layers * self.gdn_state_bytes / total if total else 0.0


@dataclass(frozen=True, slots=True)
class HandoffSettings:
    """The rule's knobs."""

    # Fewer prompt tokens to compute than this: the prefill stays with the decode.
    min_uncached_tokens: int = 1024
    # The transfer must cost at most this share of the decode-seconds the prefill would
    # have delayed on a decode worker (its seconds x the sequences decoding there).
    max_transfer_share: float = 0.5
    # Fixed cost of one handoff (connection, setup, the receiver's report), seconds.
    latency_seconds: float = 0.001
    # Prefill work already waiting per prefill worker beyond which a prompt stays
    # co-located: a backed-up prefill pool would cost its time to first token more than
    # the decode worker's chunks would (inf: no bound).
    max_prefill_wait_seconds: float = float("inf")
    # The longest transfer at all: the gap it adds before the sequence's second token
    # (a TPOT target, say; inf: no bound).
    max_transfer_seconds: float = float("inf")

    def __post_init__(self) -> None:
        if self.min_uncached_tokens < 0 or self.max_transfer_share <= 0:
            raise ValueError("min_uncached_tokens >= 0 and max_transfer_share > 0 needed")
        if min(self.latency_seconds, self.max_prefill_wait_seconds, self.max_transfer_seconds) < 0:
            raise ValueError("latency and the maximum wait and transfer must not be negative")


@dataclass(frozen=True, slots=True)
class HandoffInput:
    """One request, as the rule weighs it."""

    prompt_tokens: int
    # Of those, tokens the decode-side worker would resume from its prefix cache.
    cached_tokens: int
    # How long the uncached tokens' prefill takes on a worker of the fleet, seconds.
    prefill_seconds: float
    # Sequences decoding on the decode worker the request would otherwise share.
    num_decoding: int
    # The slower of the sender's and receiver's reported rates; 0: unknown (no handoff).
    transfer_bytes_per_second: float
    # Prefill work queued or running per prefill worker, seconds.
    prefill_wait_seconds: float = 0.0


class HandoffReason(enum.Enum):
    """Why the rule chose as it did (a metrics label: bounded)."""

    PAYS = "pays"
    SHORT_PROMPT = "short_prompt"  # few uncached tokens: short or mostly cached
    IDLE_DECODE = "idle_decode"  # nothing decoding there: the prefill delays no one
    PREFILL_BUSY = "prefill_busy"  # the prefill workers are backed up
    NO_RATE = "no_rate"  # the workers reported no transfer rate
    SLOW_TRANSFER = "slow_transfer"  # the transfer costs more than it saves


@dataclass(frozen=True, slots=True)
class HandoffChoice:
    handoff: bool
    reason: HandoffReason
    num_bytes: int
    transfer_seconds: float  # inf when the rate is unknown
    # Decode-seconds the prefill would have cost the decode worker's sequences.
    decode_seconds_saved: float


def choose_handoff(
    request: HandoffInput, shape: ModelShape, settings: HandoffSettings
) -> HandoffChoice:
    """Hand off when the uncached prompt is long, the decode worker is busy, the prefill
    workers are not backed up and the transfer costs less than `max_transfer_share` of
    the decode time it saves, and at most `max_transfer_seconds`."""
    # The sender holds the whole prompt (and the first token) when it hands off.
    num_bytes = shape.handoff_bytes(request.prompt_tokens + 1)
    rate = request.transfer_bytes_per_second
    transfer = num_bytes / rate + settings.latency_seconds if rate > 0 else float("inf")
    saved = request.prefill_seconds * request.num_decoding
    uncached = request.prompt_tokens - request.cached_tokens
    if uncached < settings.min_uncached_tokens:
        reason = HandoffReason.SHORT_PROMPT
    elif rate <= 0:
        reason = HandoffReason.NO_RATE
    elif request.num_decoding == 0:
        reason = HandoffReason.IDLE_DECODE
    elif request.prefill_wait_seconds > settings.max_prefill_wait_seconds:
        reason = HandoffReason.PREFILL_BUSY
    elif transfer > min(settings.max_transfer_share * saved, settings.max_transfer_seconds):
        reason = HandoffReason.SLOW_TRANSFER
    else:
        reason = HandoffReason.PAYS
    return HandoffChoice(reason is HandoffReason.PAYS, reason, num_bytes, transfer, saved)


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """What placement reads of one worker."""

    worker_id: str
    role: WorkerRole
    num_decoding: int
    free_kv_pages: int
    page_size: int
    transfer_bytes_per_second: float = 0.0
    draining: bool = False


def pick_prefill_worker(workers: Iterable[WorkerLoad]) -> WorkerLoad | None:
    """The prefill-only worker with the fewest sequences; None if there is none (then the
    prompt stays co-located on a worker that runs both)."""
    candidates = [w for w in workers if w.role is WorkerRole.PREFILL and not w.draining]
    return min(candidates, key=lambda w: (w.num_decoding, w.worker_id), default=None)


def pick_decode_worker(workers: Iterable[WorkerLoad], num_tokens: int) -> WorkerLoad | None:
    """The decode-capable worker with room for `num_tokens` and the fewest sequences
    decoding (ties: most free pages, then id); None when none has room."""
    candidates = [
        w
        for w in workers
        if w.role.decodes
        and not w.draining
        and w.free_kv_pages * w.page_size >= num_tokens + 1  # and the next token
    ]
    return min(
        candidates,
        key=lambda w: (w.num_decoding, -w.free_kv_pages, w.worker_id),
        default=None,
    )
