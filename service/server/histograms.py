"""A Prometheus histogram that takes many observations of one value in one call.

prometheus_client's Histogram.observe counts one observation a call (a lock and a walk
over the buckets each time). The scheduler's inter-token latency has one value for every
sequence whose previous tokens came in the same earlier report: hundreds of
observations of one value per SelectBatch, counted here as one `observe(value, count)`.
Exported exactly as a Histogram of the same name and buckets is (`_bucket`, `_count`,
`_sum`), without `_created`.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from itertools import accumulate

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString


class TallyHistogram:
    """An unlabelled histogram; `observe(value, count)` counts `count` observations."""

    def __init__(
        self, name: str, documentation: str, buckets: Iterable[float], registry: CollectorRegistry
    ) -> None:
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self._name = name
        self._documentation = documentation
        self._bounds = bounds
        self._labels = [floatToGoString(b) for b in bounds]
        self._counts = [0] * len(bounds)  # per bucket, not cumulative
        self._sum = 0.0
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        """`count` observations of `value` (the first bucket whose bound is >= value,
        as Histogram.observe places one)."""
        self._counts[bisect_left(self._bounds, value)] += count
        self._sum += value * count

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self._name, self._documentation)]

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self._name, self._documentation)
        cumulative = accumulate(list(self._counts))
        family.add_metric([], list(zip(self._labels, cumulative)), sum_value=self._sum)
        yield family
