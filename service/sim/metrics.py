"""A run's figures: latency percentiles, throughput, preemptions (seconds and counts).

- TTFT: arrival to the first output token reaching the scheduler;
- TPOT: each request's mean time between its output tokens, (last - first) / (n - 1), for
  requests with at least 2 tokens; percentiles over requests;
- end-to-end: arrival to finish; queueing delay: arrival to first admission;
- output tokens/s: all output tokens over the makespan (first arrival to last finish);
- preemptions: sequences evicted for lack of room, by the workers or by the scheduler;
- prefix cache: `prefix_hit_rate` = prompt tokens resumed from a worker's prefix cache /
  all prompt tokens prefilled (resumed + computed; a prompt prefilled again after a
  preemption counts again), `computed_prefill_tokens`, `cached_prefill_tokens`,
  `cache_misses` (first chunks whose resume point was gone);
- balance: `worker_shares`, each worker's share of the requests (by the worker of each
  request's latest admission), and `max_share_over_mean` (the largest share over the
  mean share 1 / workers).
Percentiles are nearest-rank (common.loadgen.percentile).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from common.loadgen import percentile
from service.sim.simulator import RunOutcome

# The JSON keys of one run, in order (an interface: tools that read the runs rely on it).
JSON_KEYS = (
    "policy",
    "qps",
    "num_requests",
    "workers",
    "routing",
    "ttft_p50",
    "ttft_p90",
    "ttft_p99",
    "tpot_p50",
    "tpot_p90",
    "tpot_p99",
    "e2e_p50",
    "e2e_p99",
    "queue_p50",
    "queue_p99",
    "output_tokens_per_s",
    "preemptions",
    "makespan",
    "prefix_hit_rate",
    "computed_prefill_tokens",
    "cached_prefill_tokens",
    "cache_misses",
    "worker_shares",
    "max_share_over_mean",
)


@dataclass(frozen=True)
class RunResult:
    """The figures of one run, as the JSON output holds them."""

    policy: str
    qps: float
    num_requests: int
    workers: int
    routing: str
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    tpot_p50: float
    tpot_p90: float
    tpot_p99: float
    e2e_p50: float
    e2e_p99: float
    queue_p50: float
    queue_p99: float
    output_tokens_per_s: float
    preemptions: int
    makespan: float
    prefix_hit_rate: float = 0.0
    computed_prefill_tokens: int = 0
    cached_prefill_tokens: int = 0
    cache_misses: int = 0
    worker_shares: dict[str, float] = field(default_factory=dict)
    max_share_over_mean: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class LatencySamples:
    """One run's per-request latencies, each list sorted (seconds): what its percentiles
    are of, kept to pool runs (several seeds) into one percentile."""

    ttft: list[float]
    tpot: list[float]
    queue: list[float]


def latency_samples(outcome: RunOutcome) -> LatencySamples:
    records = outcome.records
    served = [r for r in records if r.first_token_at is not None]  # FAILED ones may have none
    return LatencySamples(
        ttft=sorted(r.first_token_at - r.request.arrival_seconds for r in served),
        tpot=sorted(
            (r.last_token_at - r.first_token_at) / (r.num_tokens - 1)
            for r in served
            if r.num_tokens > 1
        ),
        queue=sorted(
            r.admitted_at - r.request.arrival_seconds for r in records if r.admitted_at is not None
        ),
    )


def summarize(
    outcome: RunOutcome, *, policy: str, qps: float, workers: int, routing: str
) -> RunResult:
    records = outcome.records
    samples = latency_samples(outcome)
    ttft, tpot, queue = samples.ttft, samples.tpot, samples.queue
    e2e = sorted(r.finished_at - r.request.arrival_seconds for r in records)
    start = min(r.request.arrival_seconds for r in records)
    makespan = max(r.finished_at for r in records) - start
    num_tokens = sum(r.num_tokens for r in records)
    prefilled = outcome.computed_prefill_tokens + outcome.cached_prefill_tokens
    counts = dict.fromkeys(outcome.worker_ids, 0)
    for r in records:
        if r.worker_id:
            counts[r.worker_id] = counts.get(r.worker_id, 0) + 1
    shares = {w: n / len(records) for w, n in counts.items()}
    return RunResult(
        policy=policy,
        qps=qps,
        num_requests=len(records),
        workers=workers,
        routing=routing,
        ttft_p50=_p(ttft, 50),
        ttft_p90=_p(ttft, 90),
        ttft_p99=_p(ttft, 99),
        tpot_p50=_p(tpot, 50),
        tpot_p90=_p(tpot, 90),
        tpot_p99=_p(tpot, 99),
        e2e_p50=_p(e2e, 50),
        e2e_p99=_p(e2e, 99),
        queue_p50=_p(queue, 50),
        queue_p99=_p(queue, 99),
        output_tokens_per_s=num_tokens / makespan if makespan > 0 else 0.0,
        preemptions=outcome.engine_preemptions + outcome.scheduler_preemptions,
        makespan=makespan,
        prefix_hit_rate=outcome.cached_prefill_tokens / prefilled if prefilled else 0.0,
        computed_prefill_tokens=outcome.computed_prefill_tokens,
        cached_prefill_tokens=outcome.cached_prefill_tokens,
        cache_misses=outcome.cache_misses,
        worker_shares=shares,
        max_share_over_mean=max(shares.values()) * len(shares) if shares else 0.0,
    )


def _p(sorted_values: list[float], percent: float) -> float:
    return percentile(sorted_values, percent) if sorted_values else 0.0
