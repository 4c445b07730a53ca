"""Just enough PromQL reading for the stack tests: which metric names an expression uses.

Not a parser: it drops strings, label matchers, range/subquery brackets and grouping
clauses, then takes every identifier that is not called like a function and is not a
keyword. Good enough for the dashboard and the alert rules, and pinned by its own tests.
"""

from __future__ import annotations

import re

# Grafana's interval variables, and what the tests put in their place.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m"}

_KEYWORDS = frozenset(
    {
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "inf",
        "nan",
    }
)
_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^}]*\}")
_BRACKETS = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"(?<![\w:.$])([A-Za-z_:][\w:]*)(\s*\()?")


def substitute_grafana_variables(expr: str) -> str:
    """The expression as Prometheus would receive it from Grafana."""
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def metric_names(expr: str) -> set[str]:
    """Names of the series an expression selects (`up`, `x_bucket`, ...), without labels."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _BRACKETS.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for match in _IDENTIFIER.finditer(text):
        name, called = match.group(1), match.group(2)
        if called or name.lower() in _KEYWORDS:
            continue
        names.add(name)
    return names


def exposed_names(metrics_text: str) -> set[str]:
    """Sample names in a Prometheus text exposition (`x_bucket`, `x_total`, `x_created`, ...)."""
    names = set()
    for line in metrics_text.splitlines():
        match = re.match(r"[A-Za-z_:][\w:]*", line)
        if match and not line.startswith("#"):
            names.add(match.group(0))
    return names
