"""Scheduler settings and their validation (the seed's `BatchConfig::validate`, extended)."""
from __future__ import annotations

from dataclasses import dataclass, fields

from service.core.errors import ConfigError

POLICIES = ("fifo",)


@dataclass(frozen=True)
class SchedulerConfig:
    """Every setting of the scheduler, with the contract's defaults."""

    max_batch_size: int = 32
    # The most a worker may ask for at registration (its answer says what is in force).
    max_worker_batch_size: int = 1024
    chunk_size: int = 512
    prefill_reserve_pages: int = 8
    max_seq_len: int = 4096
    max_queue: int = 100_000
    max_queue_per_tenant: int = 0  # 0: no per-tenant limit
    lease_ttl_ms: int = 10_000
    policy: str = "fifo"

    def validate(self) -> "SchedulerConfig":
        """Return self, or raise ConfigError naming the first bad setting and its limit."""
        for f in fields(self):
            value = getattr(self, f.name)
            expected = str if f.name == "policy" else int
            if not isinstance(value, expected) or isinstance(value, bool):
                raise ConfigError(f"{f.name} must be {expected.__name__}, got {value!r}")
        _at_least("max_batch_size", self.max_batch_size, 1)
        _at_least("max_worker_batch_size", self.max_worker_batch_size, 1)
        _at_least("chunk_size", self.chunk_size, 1)
        _at_least("max_seq_len", self.max_seq_len, 1)
        _at_least("prefill_reserve_pages", self.prefill_reserve_pages, 0)
        _at_least("max_queue", self.max_queue, 1)
        _at_least("max_queue_per_tenant", self.max_queue_per_tenant, 0)
        _at_least("lease_ttl_ms", self.lease_ttl_ms, 1)
        if self.chunk_size > self.max_seq_len:
            raise ConfigError(
                f"chunk_size ({self.chunk_size}) must not exceed max_seq_len ({self.max_seq_len})"
            )
        for name in ("max_batch_size", "max_worker_batch_size", "chunk_size", "max_seq_len",
                     "prefill_reserve_pages", "max_queue", "lease_ttl_ms"):
            # Every one of these travels in a uint32 field on the wire.
            if getattr(self, name) > 2**32 - 1:
                raise ConfigError(f"{name} must be at most {2**32 - 1}, got {getattr(self, name)}")
        if self.max_batch_size > self.max_worker_batch_size:
            raise ConfigError(
                f"max_batch_size ({self.max_batch_size}) must not exceed max_worker_batch_size "
                f"({self.max_worker_batch_size})"
            )
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        return self


def _at_least(name: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {value}")
