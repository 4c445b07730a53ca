"""SchedulerConfig.validate: the seed's BatchConfig::validate checks, and the service's own."""

import pytest

from service.core import ConfigError, Scheduler, SchedulerConfig


def test_defaults_equal_the_contract():
    config = SchedulerConfig()
    assert (
        config.max_batch_size,
        config.chunk_size,
        config.prefill_reserve_pages,
        config.max_seq_len,
    ) == (32, 512, 8, 4096)
    assert (
        config.token_budget,
        config.first_chunk_floor,
        config.aging_seconds,
        config.max_loras,
    ) == (2048, 32, 30.0, 0)
    # The watermark defaults to 1% of a worker's pages, at least 1.
    assert (config.kv_watermark(1000), config.kv_watermark(50)) == (10, 1)
    # The simulator's figures chose budget (docs/policies.md, "The default").
    assert config.policy == "budget"
    assert config.validate() is config


@pytest.mark.parametrize(
    "name", ["max_batch_size", "chunk_size", "max_seq_len", "max_queue", "lease_ttl_ms"]
)
def test_zero_is_rejected_naming_the_setting(name):
    with pytest.raises(ConfigError, match=rf"^{name} must be at least 1, got 0"):
        SchedulerConfig(**{name: 0}).validate()


@pytest.mark.parametrize(
    "name", ["max_batch_size", "chunk_size", "max_seq_len", "max_queue", "lease_ttl_ms"]
)
def test_one_is_the_smallest_accepted_value(name):
    overrides = {name: 1}
    if name == "max_seq_len":
        overrides["chunk_size"] = 1
    SchedulerConfig(**overrides).validate()


def test_negative_prefill_reserve_pages_is_rejected_but_zero_is_accepted():
    SchedulerConfig(prefill_reserve_pages=0).validate()
    with pytest.raises(ConfigError, match=r"^prefill_reserve_pages must be at least 0, got -1"):
        SchedulerConfig(prefill_reserve_pages=-1).validate()


def test_chunk_size_above_max_seq_len_is_rejected_naming_both():
    with pytest.raises(ConfigError, match=r"chunk_size \(513\).*max_seq_len \(512\)"):
        SchedulerConfig(chunk_size=513, max_seq_len=512).validate()


def test_chunk_size_equal_to_max_seq_len_is_accepted():
    SchedulerConfig(chunk_size=512, max_seq_len=512).validate()


@pytest.mark.parametrize(
    "name",
    [
        "max_batch_size",
        "max_worker_batch_size",
        "chunk_size",
        "max_seq_len",
        "prefill_reserve_pages",
        "max_queue",
        "lease_ttl_ms",
    ],
)
def test_values_beyond_uint32_are_rejected_naming_the_setting(name):
    too_big = 2**32
    overrides = {name: too_big}
    if name == "chunk_size":
        overrides["max_seq_len"] = too_big  # so the chunk_size <= max_seq_len check passes
    with pytest.raises(ConfigError, match=rf"^{name} must be at most {2**32 - 1}"):
        SchedulerConfig(**overrides).validate()


@pytest.mark.parametrize("value", ["32", 32.0, True, None])
def test_non_integer_setting_is_rejected_naming_the_setting(value):
    with pytest.raises(ConfigError, match=r"^max_batch_size must be int"):
        SchedulerConfig(max_batch_size=value).validate()


def test_non_string_policy_is_rejected():
    with pytest.raises(ConfigError, match=r"^policy must be str"):
        SchedulerConfig(policy=1).validate()


def test_unknown_policy_is_rejected_listing_the_known_ones():
    with pytest.raises(ConfigError, match=r"^policy must be one of fifo, budget, fair, got 'lifo'"):
        SchedulerConfig(policy="lifo").validate()


def test_scheduler_refuses_an_invalid_config():
    with pytest.raises(ConfigError, match="max_batch_size"):
        Scheduler(SchedulerConfig(max_batch_size=0))
