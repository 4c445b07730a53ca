"""Scheduler settings and their validation (the seed's `BatchConfig::validate`, extended)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from service.core import registry
from service.core.errors import ConfigError

# The policy names a config accepts (service/core/registry.py).
POLICIES = tuple(registry.POLICIES)
DEFAULT_POLICY = registry.DEFAULT_POLICY
DEFAULT_TOKEN_BUDGET = 2048
DEFAULT_MIN_PREFILL_CHUNK = 32
_UINT32_MAX = 2**32 - 1

# tenant -> weight (a weight-2 tenant is served twice the tokens of a weight-1 one).
TenantWeights = tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class SchedulerConfig:
    """Every setting of the scheduler, with the defaults of docs/contract.md."""

    max_batch_size: int = 32
    # The most a worker may ask for at registration (its answer says what is in force).
    max_worker_batch_size: int = 1024
    chunk_size: int = 512
    prefill_reserve_pages: int = 8
    max_seq_len: int = 4096
    max_queue: int = 100_000
    max_queue_per_tenant: int = 0  # 0: no per-tenant limit
    lease_ttl_ms: int = 10_000
    policy: str = DEFAULT_POLICY
    # The budget and fair policies (docs/contract.md, "Policies"). 0 means the default:
    # 2048 tokens (or max_batch_size if larger); a first chunk of at least 32 tokens (or
    # chunk_size if smaller); a watermark of 1% of the worker's total pages, at least 1.
    max_num_batched_tokens: int = 0
    min_prefill_chunk: int = 0
    kv_watermark_pages: int = 0
    aging_seconds: float = 30.0
    tenant_weights: TenantWeights = ()
    # Every policy: distinct adapters per worker (0: no limit).
    max_loras: int = 0
    # Latency targets of the budget and fair policies, in milliseconds (0: off). A TPOT
    # target sizes each decision's token budget from the worker's learned step times; a
    # TTFT target orders each priority band by deadline and sheds late urgent requests.
    tpot_target_ms: float = 0.0
    ttft_target_ms: float = 0.0
    # Every policy: "on" uses the workers' prefix caches (resume points, cached_tokens on
    # first chunks); "off" ignores every cache report and never sets cached_tokens.
    prefix_caching: str = "on"
    # Prefill/decode disaggregation: prompts with fewer tokens to compute than this stay
    # with a worker that decodes (a prefill-only worker is not given them).
    handoff_min_tokens: int = 1024
    # Prefill/decode disaggregation: "threshold" hands off every prompt of at least
    # handoff_min_tokens to compute; "priced" asks service/core/decide/handoff.py's rule
    # (transfer time against the receiver's decodes) where the sender registered its
    # handoff sizes. Default threshold: the priced rule kept long prompts on an idle decode
    # worker and made later decodes wait (docs/disaggregation.md, bench/disagg.py).
    handoff_rule: str = "threshold"

    def validate(self) -> SchedulerConfig:
        """Return self, or raise ConfigError naming the first bad setting and its limit."""
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name))
        _at_least("max_batch_size", self.max_batch_size, 1)
        _at_least("max_worker_batch_size", self.max_worker_batch_size, 1)
        _at_least("chunk_size", self.chunk_size, 1)
        _at_least("max_seq_len", self.max_seq_len, 1)
        _at_least("prefill_reserve_pages", self.prefill_reserve_pages, 0)
        _at_least("max_queue", self.max_queue, 1)
        _at_least("max_queue_per_tenant", self.max_queue_per_tenant, 0)
        _at_least("lease_ttl_ms", self.lease_ttl_ms, 1)
        _at_least("max_num_batched_tokens", self.max_num_batched_tokens, 0)
        _at_least("min_prefill_chunk", self.min_prefill_chunk, 0)
        _at_least("kv_watermark_pages", self.kv_watermark_pages, 0)
        _at_least("max_loras", self.max_loras, 0)
        _at_least("handoff_min_tokens", self.handoff_min_tokens, 0)
        if self.chunk_size > self.max_seq_len:
            raise ConfigError(
                f"chunk_size ({self.chunk_size}) must not exceed max_seq_len ({self.max_seq_len})"
            )
        for name in (
            "max_batch_size",
            "max_worker_batch_size",
            "chunk_size",
            "max_seq_len",
            "prefill_reserve_pages",
            "max_queue",
            "lease_ttl_ms",
            "max_num_batched_tokens",
            "min_prefill_chunk",
            "kv_watermark_pages",
            "max_loras",
            "handoff_min_tokens",
        ):
            # Every one of these travels in a uint32 field on the wire, or bounds one.
            if getattr(self, name) > _UINT32_MAX:
                raise ConfigError(
                    f"{name} must be at most {_UINT32_MAX}, got {getattr(self, name)}"
                )
        if self.max_num_batched_tokens and self.max_num_batched_tokens < self.max_batch_size:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_batch_size ({self.max_batch_size}): every running sequence decodes one "
                "token of the budget"
            )
        for name in ("chunk_size", "max_seq_len"):
            if self.min_prefill_chunk and self.min_prefill_chunk > getattr(self, name):
                raise ConfigError(
                    f"min_prefill_chunk ({self.min_prefill_chunk}) must not "
                    f"exceed {name} ({getattr(self, name)})"
                )
        for name in ("tpot_target_ms", "ttft_target_ms"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(
                    f"{name} must be a number of milliseconds >= 0 (0: off), got {value!r}"
                )
            if value and self.policy == "fifo":
                raise ConfigError(
                    f"{name} needs the budget or fair policy: fifo has no "
                    "token budget to size and keeps arrival order"
                )
        if not (math.isfinite(self.aging_seconds) and self.aging_seconds > 0):
            raise ConfigError(
                f"aging_seconds must be a positive number of seconds, got {self.aging_seconds!r}"
            )
        for tenant, weight in self.tenant_weights:
            if not (
                isinstance(weight, (int, float))
                and not isinstance(weight, bool)
                and math.isfinite(weight)
                and weight > 0
            ):
                raise ConfigError(
                    f"tenant_weights: tenant {tenant!r} has weight {weight!r}; "
                    "weights must be positive numbers"
                )
        if self.max_batch_size > self.max_worker_batch_size:
            raise ConfigError(
                f"max_batch_size ({self.max_batch_size}) must not exceed max_worker_batch_size "
                f"({self.max_worker_batch_size})"
            )
        if self.handoff_rule not in ("threshold", "priced"):
            raise ConfigError(
                f"handoff_rule must be threshold or priced, got {self.handoff_rule!r}"
            )
        if self.prefix_caching not in ("on", "off"):
            raise ConfigError(f"prefix_caching must be on or off, got {self.prefix_caching!r}")
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        return self

    @property
    def token_budget(self) -> int:
        """B: tokens per worker iteration under the budget and fair policies."""
        return self.max_num_batched_tokens or max(DEFAULT_TOKEN_BUDGET, self.max_batch_size)

    @property
    def first_chunk_floor(self) -> int:
        """C: no first chunk shorter than this (or than the prompt) is started."""
        return self.min_prefill_chunk or min(
            DEFAULT_MIN_PREFILL_CHUNK, self.chunk_size, self.max_seq_len
        )

    @property
    def learns_step_times(self) -> bool:
        """Whether the scheduler learns each worker's step times (a target is set)."""
        return bool(self.tpot_target_ms or self.ttft_target_ms)

    def tenant_weight(self, tenant: str) -> float:
        """A tenant's weight (1 unless --tenant-weights names it)."""
        return dict(self.tenant_weights).get(tenant, 1.0)

    def kv_watermark(self, total_kv_pages: int) -> int:
        """M: free pages the budget policies keep in reserve on a worker of this size."""
        if self.kv_watermark_pages:
            return self.kv_watermark_pages
        return max(1, total_kv_pages // 100)


def _check_type(name: str, value: object) -> None:
    if name in ("policy", "prefix_caching", "handoff_rule"):
        ok, expected = isinstance(value, str), "str"
    elif name in ("aging_seconds", "tpot_target_ms", "ttft_target_ms"):
        ok, expected = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    elif name == "tenant_weights":
        ok = isinstance(value, tuple) and all(
            isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
            for item in value
        )
        expected = "a tuple of (tenant, weight) pairs"
    else:
        ok, expected = isinstance(value, int) and not isinstance(value, bool), "int"
    if not ok:
        raise ConfigError(f"{name} must be {expected}, got {value!r}")


def _at_least(name: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {value}")
