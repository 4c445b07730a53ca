"""Prometheus metrics of the gateway, on an injected CollectorRegistry.

Base units in names, `_total` counters, bounded labels: `endpoint` is one of the routes
below or "other", `status_code` an HTTP status the gateway answered with.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "lattice_gateway_"
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
OTHER_ENDPOINT = "other"
# Whole requests: a health check takes a millisecond, a long completion minutes.
_REQUEST_SECONDS_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    320.0,
)
_FIRST_TOKEN_SECONDS_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)


def endpoint_label(path: str) -> str:
    return path if path in ENDPOINTS else OTHER_ENDPOINT


class GatewayMetrics:
    """What an operator reads about the HTTP side: requests, latency, tokens, disconnects."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            PREFIX + "requests",
            "HTTP requests answered, by endpoint and status code",
            ["endpoint", "status_code"],
            registry=registry,
        )
        self.request_duration = Histogram(
            PREFIX + "request_duration_seconds",
            "Time from a request's arrival to the end of its answer (streams included)",
            ["endpoint"],
            buckets=_REQUEST_SECONDS_BUCKETS,
            registry=registry,
        )
        self.requests_in_progress = Gauge(
            PREFIX + "requests_in_progress",
            "HTTP requests being answered now",
            ["endpoint"],
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from a completion request's arrival to its first text",
            ["endpoint"],
            buckets=_FIRST_TOKEN_SECONDS_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens",
            "Prompt tokens of the completions submitted",
            ["endpoint"],
            registry=registry,
        )
        self.completion_tokens = Counter(
            PREFIX + "completion_tokens",
            "Tokens of the completions answered",
            ["endpoint"],
            registry=registry,
        )
        self.client_disconnects = Counter(
            PREFIX + "client_disconnects",
            "Completion requests whose client left before the answer ended",
            ["endpoint"],
            registry=registry,
        )
        for endpoint in ENDPOINTS[:2]:  # series exist from the start, at zero
            for metric in (self.prompt_tokens, self.completion_tokens, self.client_disconnects):
                metric.labels(endpoint)


class MetricsMiddleware:
    """Counts every request by endpoint and status, and times it to its last byte."""

    def __init__(self, app, metrics: GatewayMetrics) -> None:
        self._app = app
        self._metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        endpoint = endpoint_label(scope["path"])
        status = {"code": 500}

        async def send_and_note(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        started = time.perf_counter()
        in_progress = self._metrics.requests_in_progress.labels(endpoint)
        in_progress.inc()
        try:
            await self._app(scope, receive, send_and_note)
        finally:
            in_progress.dec()
            self._metrics.request_duration.labels(endpoint).observe(time.perf_counter() - started)
            self._metrics.requests.labels(endpoint, str(status["code"])).inc()
