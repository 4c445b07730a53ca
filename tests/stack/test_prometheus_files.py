"""deploy/prometheus/ checked by the real promtool."""

from __future__ import annotations

import subprocess

from .stack_files import ALERTS, ALERTS_TEST, PROMETHEUS_CONFIG

PROMTOOL_TIMEOUT_SECONDS = 30


def _promtool(promtool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [promtool, *args], capture_output=True, text=True, timeout=PROMTOOL_TIMEOUT_SECONDS
    )


def test_promtool_check_config_passes_on_the_stack_prometheus_config(promtool):
    result = _promtool(promtool, "check", "config", str(PROMETHEUS_CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_check_rules_passes_on_the_alerts(promtool):
    result = _promtool(promtool, "check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_show_each_alert_firing_when_it_should_and_only_then(promtool):
    result = _promtool(promtool, "test", "rules", str(ALERTS_TEST))
    assert result.returncode == 0, result.stdout + result.stderr
