"""The metric-name reader the stack tests use on PromQL."""

from __future__ import annotations

from .promql import exposed_names, metric_names, substitute_grafana_variables


def test_metric_names_skips_functions_grouping_labels_and_ranges():
    expr = (
        "histogram_quantile(0.99, sum by (le) (rate("
        'lattice_scheduler_select_batch_duration_seconds_bucket{job="a", le!="x"}[5m]))) > 0.01'
    )
    assert metric_names(expr) == {"lattice_scheduler_select_batch_duration_seconds_bucket"}


def test_metric_names_reads_both_sides_of_a_binary_operator():
    expr = "max(a_metric) == 0 or absent(b_metric) and on (x) c:recorded offset 5m"
    assert metric_names(expr) == {"a_metric", "b_metric", "c:recorded"}


def test_metric_names_after_grafana_variables_are_substituted():
    expr = substitute_grafana_variables("sum(rate(x_total[$__rate_interval])) by (reason)")
    assert expr == "sum(rate(x_total[1m])) by (reason)"
    assert metric_names(expr) == {"x_total"}


def test_exposed_names_are_sample_names_not_comments():
    text = (
        "# HELP x_seconds Time.\n# TYPE x_seconds histogram\n"
        'x_seconds_bucket{le="1.0"} 1.0\nx_seconds_count 1.0\ny 2\n'
    )
    assert exposed_names(text) == {"x_seconds_bucket", "x_seconds_count", "y"}
