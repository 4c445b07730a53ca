"""The metrics observer, driven through the core with a fake clock and its own registry."""

from prometheus_client import CollectorRegistry

from service.core import FinishReason, Scheduler, TokenUpdate, WorkerReport
from service.server.metrics import SchedulerMetrics
from tests.unit.factories import FakeClock, admit, finished, make_config, register, report, submit


def _setup():
    clock = FakeClock()
    registry = CollectorRegistry()
    sched = Scheduler(make_config(), observer=SchedulerMetrics(registry, clock=clock), clock=clock)
    return clock, registry, sched


def _value(registry, name, **labels):
    return registry.get_sample_value(name, labels or None)


def test_token_latencies_and_counts_follow_the_reports():
    clock, registry, sched = _setup()
    register(sched)
    seq_id = submit(sched, prompt_len=6, max_new_tokens=4)
    admit(sched)
    clock.advance_ms(500)
    sched.select_batch(
        WorkerReport(
            "w0",
            running=(seq_id,),
            kv_free_pages=100,
            gdn_free_slots=8,
            tokens=(TokenUpdate(seq_id, (1,)),),
        )
    )
    clock.advance_ms(200)
    sched.select_batch(
        WorkerReport(
            "w0",
            running=(seq_id,),
            kv_free_pages=100,
            gdn_free_slots=8,
            tokens=(TokenUpdate(seq_id, (2, 3)),),
        )
    )
    clock.advance_ms(100)
    sched.select_batch(report(finished=[finished(seq_id, FinishReason.MAX_LENGTH, 3)]))
    p = "lattice_scheduler_"
    assert _value(registry, p + "prompt_tokens_total") == 6
    assert _value(registry, p + "generation_tokens_total") == 3
    assert _value(registry, p + "time_to_first_token_seconds_count") == 1
    assert abs(_value(registry, p + "time_to_first_token_seconds_sum") - 0.5) < 1e-9
    # Two tokens 0.2 s after the previous report: 0.1 s each.
    assert _value(registry, p + "inter_token_latency_seconds_count") == 2
    assert abs(_value(registry, p + "inter_token_latency_seconds_sum") - 0.2) < 1e-9
    assert abs(_value(registry, p + "e2e_request_latency_seconds_sum") - 0.8) < 1e-9
    assert _value(registry, p + "finished_total", reason="max_length") == 1


def test_a_leaving_worker_has_its_series_removed():
    _, registry, sched = _setup()
    register(sched, "w9")
    sched.select_batch(report("w9", kv_free_pages=42))
    name = "lattice_scheduler_worker_kv_free_pages"
    assert _value(registry, name, worker_id="w9") == 42
    assert _value(registry, "lattice_scheduler_workers") == 1
    sched.deregister_worker("w9")
    assert _value(registry, name, worker_id="w9") is None
    assert _value(registry, "lattice_scheduler_workers") == 0


def _learned_step_and_a_late_first_token():
    """A scheduler with both targets whose worker reported one step time (25 ms) and
    whose one sequence got its first token after its deadline; its registry."""
    clock, registry = FakeClock(), CollectorRegistry()
    sched = Scheduler(
        make_config(policy="budget", tpot_target_ms=100.0, ttft_target_ms=300.0),
        observer=SchedulerMetrics(registry, clock=clock, ttft_target_seconds=0.3),
        clock=clock,
    )
    register(sched)
    seq_id = submit(sched, prompt_len=40, max_new_tokens=4)
    clock.advance_ms(370)
    sched.select_batch(report())  # the first chunk: a decision with work
    clock.advance_ms(30)  # past the 300 ms deadline; a 25 ms step fits the 30 ms since
    sched.select_batch(
        WorkerReport(
            "w0",
            running=(seq_id,),
            kv_free_pages=100,
            gdn_free_slots=8,
            tokens=(TokenUpdate(seq_id, (1,)),),
            last_step_us=25_000,
        )
    )
    return registry


def test_step_times_budgets_and_deadline_misses_are_metrics():
    registry = _learned_step_and_a_late_first_token()
    p = "lattice_scheduler_"
    assert _value(registry, p + "worker_step_measured_seconds", worker_id="w0") == 0.025
    predicted = _value(registry, p + "worker_step_predicted_seconds", worker_id="w0")
    assert predicted > 0.025  # the cautious default
    assert _value(registry, p + "step_time_error_ratio_count", worker_id="w0") == 1
    assert _value(registry, p + "worker_token_budget", worker_id="w0") > 40
    assert _value(registry, p + "deadline_misses_total") == 1


def test_prefix_cache_metrics_count_computed_and_cached_tokens_misses_and_points():
    from dataclasses import replace

    from common.block_hash import block_hashes
    from service.core.types import CacheReport
    from tests.unit.factories import prompt

    _, registry, sched = _setup()
    register(sched, cache_block_tokens=16, total_snapshot_slots=8)  # aligned chunks
    seq_id = submit(sched, prompt_len=100)
    points = tuple(block_hashes(prompt(100), "", 16)[:4])
    sched.select_batch(replace(report(), cache=CacheReport(added=points, reset=True)))
    p = "lattice_scheduler_"
    assert _value(registry, p + "prefill_tokens_total", source="cached") == 64
    assert _value(registry, p + "prefill_tokens_total", source="computed") == 32  # to 96
    assert _value(registry, p + "worker_resume_points", worker_id="w0") == 4
    # A miss: counted, and the sequence is admitted again from the 3 points left.
    sched.select_batch(replace(report(), cache_misses=(seq_id,)))
    assert _value(registry, p + "cache_misses_total") == 1
    assert _value(registry, p + "prefill_tokens_total", source="cached") == 64 + 48
    assert _value(registry, p + "worker_resume_points", worker_id="w0") == 3
    # The worker's own books, live: its hit rate (cached / all prefill tokens) and misses.
    assert (
        _value(registry, p + "worker_prefill_tokens_total", worker_id="w0", source="cached")
        == 64 + 48
    )
    assert _value(
        registry, p + "worker_prefill_tokens_total", worker_id="w0", source="computed"
    ) == _value(registry, p + "prefill_tokens_total", source="computed")
    assert _value(registry, p + "worker_cache_misses_total", worker_id="w0") == 1
    # Evictions: points the worker reports removed, counted once (a retried report again
    # removes nothing it still holds) and never for a point it did not have.
    assert _value(registry, p + "worker_resume_points_removed_total", worker_id="w0") == 0
    evicted = replace(report(), cache=CacheReport(removed=(points[0], points[1], 12345)))
    sched.select_batch(evicted)
    sched.select_batch(evicted)
    assert _value(registry, p + "worker_resume_points_removed_total", worker_id="w0") == 2
    assert _value(registry, p + "worker_resume_points", worker_id="w0") == 1
    sched.deregister_worker("w0")
    assert _value(registry, p + "worker_resume_points", worker_id="w0") is None
    assert (
        _value(registry, p + "worker_prefill_tokens_total", worker_id="w0", source="cached") is None
    )
    assert _value(registry, p + "worker_resume_points_removed_total", worker_id="w0") is None


def test_the_dashboard_shows_cached_against_computed_prefill_tokens():
    import json
    from pathlib import Path

    from tests.stack.promql import metric_names

    _, registry, sched = _setup()
    register(sched, cache_block_tokens=16)  # per-worker series exist once a worker is known
    dashboard = json.loads(
        (
            Path(__file__).parent.parent / "deploy" / "grafana" / "dashboards" / "lattice.json"
        ).read_text()
    )
    exprs = {t["expr"] for panel in dashboard["panels"] for t in panel["targets"]}
    prefill = [e for e in exprs if "lattice_scheduler_prefill_tokens_total" in e]
    assert prefill and all("by (source)" in e for e in prefill)
    exposed = {m.name for m in registry.collect()} | {
        s.name for m in registry.collect() for s in m.samples
    }
    for expr in exprs:
        for name in metric_names(expr):
            if any(
                word in name
                for word in ("prefill_tokens", "cache_misses", "resume_points", "placement_passed")
            ):
                assert name in exposed, f"{name} (dashboard) is not a scheduler metric"


def test_the_dashboard_shows_step_times_budgets_and_deadline_misses():
    import json
    from pathlib import Path

    from tests.stack.promql import metric_names

    registry = _learned_step_and_a_late_first_token()
    dashboard = json.loads(
        (
            Path(__file__).parent.parent / "deploy" / "grafana" / "dashboards" / "lattice.json"
        ).read_text()
    )
    used = {
        name
        for panel in dashboard["panels"]
        for t in panel["targets"]
        for name in metric_names(t["expr"])
    }
    wanted = {
        "lattice_scheduler_worker_step_predicted_seconds",
        "lattice_scheduler_worker_step_measured_seconds",
        "lattice_scheduler_step_time_error_ratio_bucket",
        "lattice_scheduler_worker_token_budget",
        "lattice_scheduler_deadline_misses_total",
    }
    assert wanted <= used, f"no panel for {sorted(wanted - used)}"
    sampled = {s.name for m in registry.collect() for s in m.samples}
    assert wanted <= sampled, f"not scheduler samples: {sorted(wanted - sampled)}"


def test_a_step_time_that_contradicts_the_cadence_is_counted_and_logged_once_per_worker(caplog):
    """Regression (outside probe): last_step_us = 1 for steps of 20 ms was learned."""
    clock, registry = FakeClock(), CollectorRegistry()
    sched = Scheduler(
        make_config(policy="budget", tpot_target_ms=100.0),
        observer=SchedulerMetrics(registry, clock=clock),
        clock=clock,
    )
    register(sched)
    seq_id = submit(sched, prompt_len=40, max_new_tokens=20)
    sched.select_batch(report())
    for step in range(5):
        clock.advance_ms(50)
        sched.select_batch(
            WorkerReport(
                "w0",
                running=(seq_id,),
                kv_free_pages=100,
                gdn_free_slots=8,
                tokens=(TokenUpdate(seq_id, (1,), offset=step),),
                last_step_us=1 if step < 3 else 2**32 - 1,
            )
        )
    p = "lattice_scheduler_step_times_refused_total"
    assert _value(registry, p, reason="shorter_than_cadence") == 3
    assert _value(registry, p, reason="longer_than_elapsed") == 2
    assert _value(registry, "lattice_scheduler_step_time_error_ratio_count", worker_id="w0") is None
    assert [r.getMessage() for r in caplog.records].count(
        "a reported step time was not learned: it contradicts what the scheduler saw; later "
        "ones of this worker are counted in lattice_scheduler_step_times_refused_total only"
    ) == 1


def test_hits_passed_by_placement_are_counted_by_rule_every_rule_from_zero():
    from service.core.vocabulary import PlacementPass

    registry = CollectorRegistry()
    metrics = SchedulerMetrics(registry, clock=FakeClock())
    name = "lattice_scheduler_placement_passed_total"
    assert {_value(registry, name, reason=r.value) for r in PlacementPass} == {0}
    metrics.on_placement_passed("w0", PlacementPass.HOLDER_AT_CAP)
    metrics.on_placement_passed("w1", PlacementPass.HOLDER_AT_CAP)
    metrics.on_placement_passed("w1", PlacementPass.CHEAPER_HERE)
    assert _value(registry, name, reason="holder_at_cap") == 2
    assert _value(registry, name, reason="cheaper_here") == 1
    assert _value(registry, name, reason="overdue") == 0
