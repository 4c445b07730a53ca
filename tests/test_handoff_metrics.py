"""The handoff metrics (service/server/handoff_metrics.py) on their own registry, and the
dashboard's handoff panels reading metrics that exist."""

import json
from pathlib import Path

from prometheus_client import CollectorRegistry

from service.core.vocabulary import HandoffEnd
from service.server.metrics import SchedulerMetrics
from tests.stack.promql import metric_names


def _value(registry, name, **labels):
    return registry.get_sample_value(name, labels or None)


def test_a_done_handoff_counts_for_both_ends_and_a_failure_only_by_its_end():
    registry = CollectorRegistry()
    metrics = SchedulerMetrics(registry)
    for worker_id in ("p0", "d0"):
        metrics.on_worker_registered(worker_id, 100, 8)
    assert _value(registry, "lattice_scheduler_handoffs_total", end="timeout") == 0
    metrics.on_handoff(1, "p0", "d0", HandoffEnd.DONE, 1000, 0.02)
    metrics.on_handoff(2, "p0", "d0", HandoffEnd.CHECKSUM, 1000, 0.03)
    assert _value(registry, "lattice_scheduler_handoffs_total", end="done") == 1
    assert _value(registry, "lattice_scheduler_handoffs_total", end="checksum") == 1
    for side, worker_id in (("sender", "p0"), ("receiver", "d0")):
        labels = {"worker_id": worker_id, "side": side}
        assert _value(registry, "lattice_scheduler_worker_handoffs_total", **labels) == 1
        assert _value(registry, "lattice_scheduler_worker_handoff_bytes_total", **labels) == 1000
        assert _value(registry, "lattice_scheduler_worker_handoff_seconds_total", **labels) == 0.02


def test_a_leaving_worker_takes_its_handoff_series_along():
    registry = CollectorRegistry()
    metrics = SchedulerMetrics(registry)
    metrics.on_worker_registered("p0", 100, 8)
    labels = {"worker_id": "p0", "side": "sender"}
    assert _value(registry, "lattice_scheduler_worker_handoffs_total", **labels) == 0
    metrics.on_worker_removed("p0")
    assert _value(registry, "lattice_scheduler_worker_handoffs_total", **labels) is None


def test_the_dashboard_handoff_panels_read_scheduler_metrics():
    registry = CollectorRegistry()
    SchedulerMetrics(registry).on_worker_registered("w0", 100, 8)  # per-worker series
    path = Path(__file__).parent.parent / "deploy" / "grafana" / "dashboards" / "lattice.json"
    dashboard = json.loads(path.read_text())
    names = {
        name
        for panel in dashboard["panels"]
        for t in panel["targets"]
        for name in metric_names(t["expr"])
        if "handoff" in name
    }
    exposed = {s.name for m in registry.collect() for s in m.samples}
    assert names == {
        "lattice_scheduler_handoffs_total",
        "lattice_scheduler_worker_handoffs_total",
        "lattice_scheduler_worker_handoff_bytes_total",
        "lattice_scheduler_worker_handoff_seconds_total",
    }
    assert names <= exposed
