"""A real scheduler on loopback, scraped by a real Prometheus; the dashboard and the alerts
are read against what the scheduler actually exposes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from common.waiting import wait_until

from .prometheus_api import GATEWAY_JOB, LOOPBACK, SCHEDULER_JOB
from .promql import exposed_names, metric_names, substitute_grafana_variables
from .stack_files import HEALTH_CHECK_SCRIPT, alert_expressions, dashboard_expressions

# Series Prometheus makes itself for every target; alerts may use them.
PROMETHEUS_SERIES = {"up"}


@pytest.mark.parametrize("source", ["scheduler", pytest.param("gateway", marks=pytest.mark.slow)])
def test_promtool_check_metrics_passes_on_the_live_metrics(promtool, source, request):
    text = request.getfixturevalue(
        "metrics_text" if source == "scheduler" else "gateway_metrics_text"
    )
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_health_check_script_passes_against_the_serving_scheduler(scheduler):
    for service in ("", "lattice.scheduler.v1.Scheduler"):
        result = subprocess.run(
            [
                sys.executable,
                str(HEALTH_CHECK_SCRIPT),
                "--target",
                f"{LOOPBACK}:{scheduler.port}",
                "--service",
                service,
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert result.returncode == 0, result.stderr


def test_health_check_script_fails_for_an_unknown_service(scheduler):
    result = subprocess.run(
        [
            sys.executable,
            str(HEALTH_CHECK_SCRIPT),
            "--target",
            f"{LOOPBACK}:{scheduler.port}",
            "--service",
            "no.such.Service",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    assert "NOT_FOUND" in result.stderr


@pytest.mark.slow  # starts a gateway, a scheduler and a worker process
@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_promql_expression_names_only_metrics_the_scheduler_or_gateway_exposes(
    source, metrics_text, gateway_metrics_text
):
    exposed = exposed_names(metrics_text) | exposed_names(gateway_metrics_text)
    expressions = dashboard_expressions() if source == "dashboard" else alert_expressions()
    assert expressions
    for expression in expressions:
        names = metric_names(substitute_grafana_variables(expression.expr))
        assert names, f"{expression.where}: no metric name found in {expression.expr!r}"
        unknown = names - exposed - PROMETHEUS_SERIES
        assert not unknown, f"{expression.where} uses {sorted(unknown)}, not in /metrics"


@pytest.mark.slow
def test_the_gateway_metrics_count_the_requests_sent_through_it(gateway_metrics_text):
    lines = set(gateway_metrics_text.splitlines())
    for sample in (
        'lattice_gateway_requests_total{endpoint="/v1/chat/completions",status_code="200"} 1.0',
        'lattice_gateway_requests_total{endpoint="/v1/completions",status_code="400"} 1.0',
        'lattice_gateway_time_to_first_token_seconds_count{endpoint="/v1/chat/completions"} 1.0',
        'lattice_gateway_completion_tokens_total{endpoint="/v1/chat/completions"} 16.0',
        'lattice_gateway_client_disconnects_total{endpoint="/v1/chat/completions"} 0.0',
    ):
        assert sample in lines, sample


@pytest.mark.slow
def test_prometheus_scrapes_the_scheduler_and_gateway_targets_and_they_are_up(
    prometheus, scheduler, gateway
):
    body = prometheus.get("/api/v1/targets")
    for job, url in (
        (SCHEDULER_JOB, f"http://{LOOPBACK}:{scheduler.metrics_port}/metrics"),
        (GATEWAY_JOB, gateway.metrics_url),
    ):
        targets = [t for t in body["data"]["activeTargets"] if t["labels"]["job"] == job]
        assert [t["scrapeUrl"] for t in targets] == [url]
        assert targets[0]["health"] == "up", targets[0]["lastError"]


@pytest.mark.slow
def test_prometheus_shows_the_queue_admissions_and_worker_gauges_the_test_caused(
    prometheus, activity
):
    worker = f'worker_id="{activity.worker_id}"'
    expected = {
        "lattice_scheduler_queue_depth": activity.queue_depth,
        "lattice_scheduler_fleet_queue_depth": activity.queue_depth,
        "lattice_scheduler_submissions_total": activity.num_submitted,
        "lattice_scheduler_admissions_total": activity.num_admitted,
        "lattice_scheduler_workers": 1,
        f"lattice_scheduler_worker_kv_free_pages{{{worker}}}": activity.kv_free_pages,
        f"lattice_scheduler_worker_gdn_free_slots{{{worker}}}": activity.gdn_free_slots,
        f"lattice_scheduler_worker_kv_total_pages{{{worker}}}": activity.total_kv_pages,
        f"lattice_scheduler_worker_running_sequences{{{worker}}}": activity.num_running,
        "lattice_scheduler_select_batch_duration_seconds_count": activity.num_reports,
    }
    # The fixture waited for two scrapes after the activity; poll anyway, bounded.
    wait_until(
        lambda: {expr: prometheus.scalar_of(expr) for expr in expected},
        "Prometheus to show the values the test caused",
        15,
        done=lambda seen: seen == expected,
        every_seconds=0.25,
    )


@pytest.mark.slow
def test_every_dashboard_expression_evaluates_to_data_in_prometheus(prometheus):
    def problems() -> dict[str, str]:
        found = {}
        for expression in dashboard_expressions():
            body = prometheus.query(substitute_grafana_variables(expression.expr))
            if body["status"] != "success":
                found[expression.where] = body.get("error")
            elif not body["data"]["result"]:
                found[expression.where] = "no data"
        return found

    wait_until(
        problems,
        "every dashboard query to return data",
        15,
        done=lambda found: found == {},
        every_seconds=0.25,
    )


@pytest.mark.slow
def test_every_alert_expression_evaluates_without_error_in_prometheus(prometheus):
    for expression in alert_expressions():
        body = prometheus.query(expression.expr)
        assert body["status"] == "success", f"{expression.where}: {body.get('error')}"


@pytest.mark.slow
def test_prometheus_loads_the_alert_rules_and_evaluates_them_cleanly(prometheus):
    def rules() -> list[dict]:
        groups = prometheus.get("/api/v1/rules")["data"]["groups"]
        return [rule for group in groups for rule in group["rules"]]

    def all_evaluated(found: list[dict]) -> bool:
        # A rule never evaluated reports the zero time, 0001-01-01T00:00:00Z.
        return bool(found) and all(not r["lastEvaluation"].startswith("0001") for r in found)

    found = wait_until(
        rules, "every alert rule to be evaluated once", 15, done=all_evaluated, every_seconds=0.25
    )
    assert {r["name"] for r in found} == {
        e.where.removeprefix("alert ") for e in alert_expressions()
    }
    assert [(r["name"], r["lastError"]) for r in found if r["health"] != "ok"] == []
    # One worker is registered and up is 1: nothing may be pending or firing.
    assert [r["name"] for r in found if r["state"] != "inactive"] == []
