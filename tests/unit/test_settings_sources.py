"""`serve` settings: a bad value's message says where that value came from."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from service import settings
from service.core import ConfigError


def _error(*flags: str, environ: dict[str, str] | None = None, config: Path | None = None) -> str:
    """The message of the ConfigError that resolving these flags, env and file raises."""
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser)
    args = parser.parse_args([*flags, *(["--config", str(config)] if config else [])])
    with pytest.raises(ConfigError) as err:
        settings.resolve(args, environ or {})
    return str(err.value)


def test_a_rule_between_two_flags_names_both_flags():
    assert _error("--chunk-size", "600", "--max-seq-len", "512") == (
        "chunk_size (600, --chunk-size) must not exceed max_seq_len (512, --max-seq-len)"
    )


def test_values_from_the_environment_and_the_config_file_say_so(tmp_path):
    config = tmp_path / "scheduler.toml"
    config.write_text("max_seq_len = 512\n")
    assert _error(environ={"LATTICE_SCHEDULER_CHUNK_SIZE": "600"}, config=config) == (
        f"chunk_size (600, env LATTICE_SCHEDULER_CHUNK_SIZE) must not exceed "
        f"max_seq_len (512, from {config})"
    )


def test_a_setting_left_at_its_default_says_default():
    assert _error("--max-seq-len", "100") == (
        "chunk_size (512, default) must not exceed max_seq_len (100, --max-seq-len)"
    )


def test_a_process_setting_names_its_source_and_not_the_words_of_the_remark(tmp_path):
    config = tmp_path / "serve.toml"
    config.write_text("port = 70000\n")
    assert _error(config=config) == (
        f"port (from {config}) must be within 0-65535 (0 picks a free port), got 70000"
    )
    assert _error(environ={"LATTICE_SCHEDULER_METRICS_PORT": "-1"}) == (
        "metrics_port (env LATTICE_SCHEDULER_METRICS_PORT) must be within 0-65535 "
        "(0 picks a free port), got -1"
    )


def test_a_type_error_names_its_source_too():
    assert _error(environ={"LATTICE_SCHEDULER_MAX_QUEUE": "many"}) == (
        "max_queue (env LATTICE_SCHEDULER_MAX_QUEUE) must be an integer, got 'many'"
    )


_NUMERIC = [
    f.name
    for f, _ in settings.setting_fields()
    if (f.type if isinstance(f.type, str) else f.type.__name__) in ("int", "float")
]


@pytest.mark.parametrize("name", _NUMERIC)
def test_every_numeric_setting_rejected_at_minus_one_names_its_env_var(name):
    env_name = settings.ENV_PREFIX + name.upper()
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser)
    # Every numeric setting refuses -1 (none means "unlimited" or "off" by it): one that
    # accepts it has lost its range check.
    with pytest.raises(ConfigError) as err:
        settings.resolve(parser.parse_args([]), {env_name: "-1"})
    assert str(err.value).startswith(f"{name} (env {env_name})"), str(err.value)


def test_names_in_quotes_flags_and_paths_are_not_mentions():
    sources = {"port": "--port", "policy": "default", "state_dir": "--state-dir"}
    assert settings.with_sources(
        "state_dir /srv/port is not a directory (see --port), got 'policy'", sources
    ) == ("state_dir (--state-dir) /srv/port is not a directory (see --port), got 'policy'")
    assert settings.with_sources("--config x: not valid TOML", sources) == (
        "--config x: not valid TOML"
    )
