"""Prometheus metrics of the scheduler, built on an injected CollectorRegistry.

Base units in names, `_total` counters, bounded labels: `reason` takes a fixed enum's
values and `worker_id` only registered workers (a worker's series go when it leaves).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from service.core import (
    BlockReason,
    Decision,
    EvictReason,
    FinishReason,
    PreemptReason,
    RequeueReason,
    SchedulerObserver,
    WorkerReport,
)
from service.core.tables.queue import PRIORITY_BANDS
from service.core.vocabulary import HandoffEnd, PlacementPass, StepTimeRefusal
from service.server.handoff_metrics import HandoffMetrics
from service.server.histograms import TallyHistogram

log = logging.getLogger(__name__)

PREFIX = "lattice_scheduler_"

# SelectBatch is answered in well under a millisecond in-process; gRPC adds ~0.1-1 ms.
_RPC_SECONDS_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
)
# Queue waits range from nothing to minutes under overload.
_WAIT_SECONDS_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
# Time to first token and end-to-end latency: LLM requests take milliseconds to minutes.
_LATENCY_SECONDS_BUCKETS = (
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
# Inter-token latency: one decode iteration, from a few to a few hundred milliseconds.
_ITL_SECONDS_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.5,
)
# The stream pools of service/server/interceptors/limits.py (a bounded label).
STREAM_KINDS = ("generate", "open")
_TOKEN_BUCKETS = (0, 1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_SEQ_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 1.0)
# Relative errors of a prediction: 1% to 10x.
_ERROR_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 10.0)
# Tenants outside --tenant-weights are counted under this label (the label set stays bounded).
OTHER_TENANT = "other"


class SchedulerMetrics(SchedulerObserver):
    """Listens to the core and keeps the metrics an operator reads."""

    def __init__(
        self,
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.monotonic,
        named_tenants: Iterable[str] = (),
        ttft_target_seconds: float = 0.0,
    ) -> None:
        """`named_tenants`: the tenants of --tenant-weights, each with its own series of
        served tokens; every other tenant is counted as "other". `ttft_target_seconds`:
        --ttft-target-ms, for the deadline misses (0: none counted)."""
        r = registry
        self._ttft_target_seconds = ttft_target_seconds
        self._clock = clock
        self._named_tenants = frozenset(named_tenants) - {OTHER_TENANT}
        # For the latency histograms, sequences submitted here and not finished: when
        # each was submitted, and when its latest tokens came, either as a worker's latest
        # report that gave it tokens (`_last_report`: worker_id -> when, and the ids it
        # gave tokens to) or, once it left that chain, on its own (`_last_token_at`).
        # Kept this way so that a report costs set operations, not a lookup per sequence.
        self._submitted_at: dict[int, float] = {}
        self._last_token_at: dict[int, float] = {}
        self._last_report: dict[str, tuple[float, set[int]]] = {}
        # Each worker's labelled children of the per-decision gauges and counter.
        self._decision_series: dict[str, tuple] = {}
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens_total", "Prompt tokens of accepted sequences.", registry=r
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens_total", "Generated tokens reported by workers.", registry=r
        )
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "From Submit to the first generated token reported by a worker.",
            buckets=_LATENCY_SECONDS_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = TallyHistogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between a sequence's token reports, per token.",
            _ITL_SECONDS_BUCKETS,
            r,
        )
        self.e2e_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "From Submit to the sequence finishing, whatever the reason.",
            buckets=_LATENCY_SECONDS_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            PREFIX + "queue_depth", "Sequences waiting for admission.", registry=r
        )
        self.submissions = Counter(
            PREFIX + "submissions_total", "Sequences accepted by Submit or Generate.", registry=r
        )
        self.admissions = Counter(
            PREFIX + "admissions_total",
            "Sequences admitted to a worker (a requeued one counts again).",
            registry=r,
        )
        self.finished = Counter(
            PREFIX + "finished_total", "Sequences finished, by reason.", ["reason"], registry=r
        )
        self.evictions = Counter(
            PREFIX + "evictions_total",
            "Ids put in a decision's evict list, by reason.",
            ["reason"],
            registry=r,
        )
        self.requeues = Counter(
            PREFIX + "requeues_total",
            "Sequences sent back to the head of the queue, by reason.",
            ["reason"],
            registry=r,
        )
        self.admissions_blocked = Counter(
            PREFIX + "admissions_blocked_total",
            "Decisions that left sequences queued, by the limit that stopped admission.",
            ["reason"],
            registry=r,
        )
        self.queue_wait = Histogram(
            PREFIX + "queue_wait_seconds",
            "Time from enqueue (or requeue) to admission.",
            buckets=_WAIT_SECONDS_BUCKETS,
            registry=r,
        )
        self.select_batch_duration = Histogram(
            PREFIX + "select_batch_duration_seconds",
            "Time to answer one SelectBatch (or WorkerSession request), from its arrival: "
            "a stalled event loop counts; time parked in a long poll does not.",
            buckets=_RPC_SECONDS_BUCKETS,
            registry=r,
        )
        self.event_loop_lag = Histogram(
            PREFIX + "event_loop_lag_seconds",
            "How late the server's event loop ran a timer due now (sampled every 25 ms): "
            "what every call waits before its handler starts.",
            buckets=_RPC_SECONDS_BUCKETS,
            registry=r,
        )
        self.state_fsyncs = Counter(
            PREFIX + "state_fsyncs_total",
            "fsyncs of the state store's WAL behind acknowledgements (group commit).",
            registry=r,
        )
        self.state_fsync_duration = Histogram(
            PREFIX + "state_fsync_duration_seconds",
            "Time one fsync of the state store's WAL took (off the event loop).",
            buckets=_RPC_SECONDS_BUCKETS,
            registry=r,
        )
        self.state_commits_per_fsync = Histogram(
            PREFIX + "state_commits_per_fsync",
            "Commits that one fsync made durable: acknowledgements that shared it.",
            buckets=_SEQ_BUCKETS,
            registry=r,
        )
        self.replica_saves_per_commit = Histogram(
            PREFIX + "replica_saves_per_commit",
            "Saves (calls' changes) that one group commit of a replica held.",
            buckets=_SEQ_BUCKETS,
            registry=r,
        )
        self.replica_commit_gathers = Counter(
            PREFIX + "replica_commit_gathers_total",
            "How a replica's group commit stopped waiting for saves before it started: "
            "enough (every busy worker had saved), expired (--replica-commit-wait-ms, or "
            "--replica-commit-due-wait-ms), due (the earliest answer due among its calls, "
            "answer_due_us), promptly (a call holding the claim lock asked), none (it did "
            "not wait).",
            ["outcome"],
            registry=r,
        )
        for outcome in ("enough", "expired", "due", "promptly", "none"):
            self.replica_commit_gathers.labels(outcome)
        self.replica_follows = Counter(
            PREFIX + "replica_follows_total",
            "Generate streams of another replica's sequence relayed from that replica "
            "(FollowSequence), by how the relay ended: finished (the sequence did), moved "
            "(the replica did not own it, or stopped owning it), refused (its stream limit, "
            "the client's credential), unreachable, silent (no event for 5 s), left (the "
            "client left), failed. All but finished and left go on reading PostgreSQL.",
            ["outcome"],
            registry=r,
        )
        for outcome in ("finished", "moved", "refused", "unreachable", "silent", "left", "failed"):
            self.replica_follows.labels(outcome)
        self.streams_open = Gauge(
            PREFIX + "streams_open",
            "Streams open now, by pool: generate (Generate, FollowSequence), open "
            "(Health.Watch, reflection).",
            ["kind"],
            registry=r,
        )
        self.streams_refused = Counter(
            PREFIX + "streams_refused_total",
            "Streams refused with RESOURCE_EXHAUSTED because their pool was full, by pool.",
            ["kind"],
            registry=r,
        )
        self.decision_prefill_tokens = Histogram(
            PREFIX + "decision_prefill_tokens",
            "Prompt tokens handed out per decision.",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.decision_decode_sequences = Histogram(
            PREFIX + "decision_decode_sequences",
            "Sequences to decode per decision.",
            buckets=_SEQ_BUCKETS,
            registry=r,
        )
        self.decision_batched_tokens = Histogram(
            PREFIX + "decision_batched_tokens",
            "Tokens per decision: one per decode plus the prefill chunks' tokens.",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.decision_budget_used = Histogram(
            PREFIX + "decision_budget_used_ratio",
            "Share of its token budget a decision spent (budget and fair policies).",
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.step_times_refused = Counter(
            PREFIX + "step_times_refused_total",
            "Reported step times not learned because they contradicted what the scheduler "
            "saw: longer than the time since the decision (longer_than_elapsed), or far "
            "shorter than the worker's busy cadence (shorter_than_cadence).",
            ["reason"],
            registry=r,
        )
        self.store_refusals = Counter(
            PREFIX + "store_refusals_total",
            "Changes the state store refused for their data (not for being unreachable): "
            "the sequences they named were failed, or the change dropped, instead of "
            "retried on every later save.",
            registry=r,
        )
        self.deadline_misses = Counter(
            PREFIX + "deadline_misses_total",
            "Sequences whose first token came after their deadline (submission + "
            "--ttft-target-ms); late ones are served, not dropped.",
            registry=r,
        )
        self.worker_token_budget = Gauge(
            PREFIX + "worker_token_budget",
            "The token budget of the worker's latest decision with work (with "
            "--tpot-target-ms: chosen from its learned step times).",
            ["worker_id"],
            registry=r,
        )
        self.worker_step_predicted = Gauge(
            PREFIX + "worker_step_predicted_seconds",
            "The learned model's prediction of the worker's latest measured step.",
            ["worker_id"],
            registry=r,
        )
        self.worker_step_measured = Gauge(
            PREFIX + "worker_step_measured_seconds",
            "The worker's latest measured step (SelectBatchRequest.last_step_us).",
            ["worker_id"],
            registry=r,
        )
        self.step_time_error = Histogram(
            PREFIX + "step_time_error_ratio",
            "|predicted - measured| / measured of each step time the scheduler learned from.",
            ["worker_id"],
            buckets=_ERROR_BUCKETS,
            registry=r,
        )
        self.preemptions = Counter(
            PREFIX + "preemptions_total",
            "Running sequences preempted: kv_growth and no_progress by the scheduler, "
            "worker by the worker itself.",
            ["reason"],
            registry=r,
        )
        self.tenant_served_tokens = Counter(
            PREFIX + "tenant_served_tokens_total",
            "Tokens served per tenant (prompt tokens prefilled, generated tokens); tenants "
            "not named in --tenant-weights count as other.",
            ["tenant"],
            registry=r,
        )
        self.queue_depth_by_priority = Gauge(
            PREFIX + "queue_depth_by_priority",
            "Sequences waiting for admission, per priority band (lower is more urgent).",
            ["band"],
            registry=r,
        )
        self.workers = Gauge(PREFIX + "workers", "Registered workers.", registry=r)
        self.fleet_queue_depth = Gauge(
            PREFIX + "fleet_queue_depth",
            "Sequences waiting for admission across the fleet: a single scheduler's queue as "
            "of its latest lease sweep; on a replica, the shared queue (every replica's queued "
            "sequences, claimed or not) as of its latest upkeep, NaN after one that could not "
            "read the database.",
            registry=r,
        )
        self.unservable_queued = Gauge(
            PREFIX + "unservable_queued",
            "Queued sequences whose adapter no live worker that takes work has (replicas: "
            "fleet-wide, as of the replica's latest upkeep); they wait until one registers.",
            registry=r,
        )
        self.worker_kv_free_pages = Gauge(
            PREFIX + "worker_kv_free_pages",
            "Last reported free KV pages.",
            ["worker_id"],
            registry=r,
        )
        self.worker_gdn_free_slots = Gauge(
            PREFIX + "worker_gdn_free_slots",
            "Last reported free GDN state slots.",
            ["worker_id"],
            registry=r,
        )
        self.worker_kv_total_pages = Gauge(
            PREFIX + "worker_kv_total_pages",
            "KV pages the worker registered with.",
            ["worker_id"],
            registry=r,
        )
        self.worker_gdn_total_slots = Gauge(
            PREFIX + "worker_gdn_total_slots",
            "GDN state slots the worker registered with.",
            ["worker_id"],
            registry=r,
        )
        self.worker_running = Gauge(
            PREFIX + "worker_running_sequences",
            "Sequences the worker last reported in decode.",
            ["worker_id"],
            registry=r,
        )
        self.worker_prefilling = Gauge(
            PREFIX + "worker_prefilling_sequences",
            "Sequences the worker last reported in prefill.",
            ["worker_id"],
            registry=r,
        )
        self.worker_iterations = Counter(
            PREFIX + "worker_iterations_total",
            "SelectBatch calls answered for the worker.",
            ["worker_id"],
            registry=r,
        )
        self.prefill_tokens = Counter(
            PREFIX + "prefill_tokens_total",
            "Prompt tokens of first and later prefill chunks: computed by the worker, or "
            "cached (taken from its prefix cache at admission).",
            ["source"],
            registry=r,
        )
        self.placement_passed = Counter(
            PREFIX + "placement_passed_total",
            "Admissions of a sequence whose longest cached prefix another worker held, by "
            "the placement rule that let the asking worker take it.",
            ["reason"],
            registry=r,
        )
        self.cache_misses = Counter(
            PREFIX + "cache_misses_total",
            "First chunks whose resume point the worker no longer held (admitted again).",
            registry=r,
        )
        self.worker_resume_points = Gauge(
            PREFIX + "worker_resume_points",
            "Prefix-cache resume points the scheduler knows for the worker.",
            ["worker_id"],
            registry=r,
        )
        # The same per worker: its own hit rate and evictions, live.
        self.worker_prefill_tokens = Counter(
            PREFIX + "worker_prefill_tokens",
            "Prompt tokens of the worker's prefill chunks: computed by it, or cached (taken "
            "from its prefix cache at admission).",
            ["worker_id", "source"],
            registry=r,
        )
        self.worker_cache_misses = Counter(
            PREFIX + "worker_cache_misses",
            "First chunks the worker could not serve from the resume point it was given.",
            ["worker_id"],
            registry=r,
        )
        self.worker_resume_points_removed = Counter(
            PREFIX + "worker_resume_points_removed",
            "Resume points the worker reported removed (evicted from its prefix cache).",
            ["worker_id"],
            registry=r,
        )
        for source in ("computed", "cached"):
            self.prefill_tokens.labels(source)
        self.handoffs = HandoffMetrics(r)
        self._worker_ids: set[str] = set()
        self._per_worker = (
            self.worker_kv_free_pages,
            self.worker_gdn_free_slots,
            self.worker_kv_total_pages,
            self.worker_gdn_total_slots,
            self.worker_running,
            self.worker_prefilling,
            self.worker_iterations,
            self.worker_token_budget,
            self.worker_step_predicted,
            self.worker_step_measured,
            self.step_time_error,
            self.worker_resume_points,
            self.worker_cache_misses,
            self.worker_resume_points_removed,
        )
        # Every reason shows from the start at 0, so rate() works before the first event.
        for reason in FinishReason:
            self.finished.labels(reason.name.lower())
        for labelled, enum_type in (
            (self.evictions, EvictReason),
            (self.requeues, RequeueReason),
            (self.admissions_blocked, BlockReason),
            (self.placement_passed, PlacementPass),
            (self.preemptions, PreemptReason),
        ):
            for member in enum_type:
                labelled.labels(member.value)
        for tenant in (*sorted(self._named_tenants), OTHER_TENANT):
            self.tenant_served_tokens.labels(tenant)
        for band in PRIORITY_BANDS:
            self.queue_depth_by_priority.labels(band)
        for kind in STREAM_KINDS:
            self.streams_open.labels(kind)
            self.streams_refused.labels(kind)

    def on_fsync(self, num_commits: int, seconds: float) -> None:
        """One group-commit fsync (service/state/group_commit.py)."""
        self.state_fsyncs.inc()
        self.state_fsync_duration.observe(seconds)
        self.state_commits_per_fsync.observe(num_commits)

    def on_replica_commit(self, num_saves: int, gathered: str) -> None:
        """One group commit of a replica (service/state/pg_commit.py): the saves it held,
        and how its wait for them ended."""
        self.replica_saves_per_commit.observe(num_saves)
        self.replica_commit_gathers.labels(gathered).inc()

    def on_replica_follow(self, outcome: str) -> None:
        """A relay of another replica's stream ended (service/replicas/peers.py)."""
        self.replica_follows.labels(outcome).inc()

    def on_streams(self, kind: str, num_open: int, refused: bool) -> None:
        """A stream pool changed (service/server/interceptors/limits.py): `num_open` now; `refused` one more."""
        self.streams_open.labels(kind).set(num_open)
        if refused:
            self.streams_refused.labels(kind).inc()

    # -- SchedulerObserver ----------------------------------------------------------

    def on_submitted(self, seq_id: int, tenant: str, prompt_len: int) -> None:
        self.submissions.inc()
        self.prompt_tokens.inc(prompt_len)
        self._submitted_at[seq_id] = self._clock()

    def on_tokens(self, seq_id: int, num_tokens: int) -> None:
        """Unused by the core (it calls on_tokens_reported); one sequence's tokens, as
        a report of its own with no worker."""
        self.on_tokens_reported("", [seq_id], [num_tokens])

    def on_tokens_reported(self, worker_id: str, seq_ids: list[int], num_tokens: list[int]) -> None:
        """Token counts, time to first token, and inter-token latency (the time since the
        sequence's previous tokens, shared by the tokens that came together). Sequences
        whose previous tokens came in this worker's previous report, the steady state,
        are counted with set operations and one observation call."""
        total = sum(num_tokens)
        self.generation_tokens.inc(total)
        submitted = self._submitted_at
        tracked = submitted.keys() & seq_ids
        now = self._clock()
        previous_at, previous = self._last_report.get(worker_id, (now, set()))
        self._leave_chain(previous_at, previous - tracked)
        self._last_report[worker_id] = (now, tracked)
        if not tracked:
            return
        if len(seq_ids) == total and len(set(seq_ids)) == total:  # a token each
            chained = tracked & previous
            if chained:
                self.inter_token_latency.observe(now - previous_at, len(chained))
            for seq_id in tracked - chained if chained else tracked:
                self._tokens_came(seq_id, None, 1, now)
            return
        counts: dict[int, int] = {}
        for seq_id, num in zip(seq_ids, num_tokens):
            counts[seq_id] = counts.get(seq_id, 0) + num
        for seq_id in tracked:
            self._tokens_came(
                seq_id, previous_at if seq_id in previous else None, counts[seq_id], now
            )

    def _tokens_came(self, seq_id: int, last_at: float | None, num_tokens: int, now: float) -> None:
        """`num_tokens` of `seq_id` came at `now`; its previous ones at `last_at` (None:
        look it up; none: these are its first)."""
        if last_at is None:
            last_at = self._last_token_at.pop(seq_id, None)
        if last_at is None:
            waited = now - self._submitted_at[seq_id]
            self.time_to_first_token.observe(waited)
            if self._ttft_target_seconds and waited > self._ttft_target_seconds:
                self.deadline_misses.inc()
        else:
            self.inter_token_latency.observe((now - last_at) / num_tokens, num_tokens)

    def _leave_chain(self, last_at: float, seq_ids: set[int]) -> None:
        """`seq_ids` got their latest tokens at `last_at` and are no longer in a worker's
        latest report: their time is kept on its own."""
        submitted = self._submitted_at
        for seq_id in seq_ids:
            if seq_id in submitted:
                self._last_token_at[seq_id] = last_at

    def on_admitted(self, seq_id: int, worker_id: str, queue_wait_seconds: float) -> None:
        self.admissions.inc()
        self.queue_wait.observe(queue_wait_seconds)

    def on_requeued(self, seq_id: int, worker_id: str, reason: RequeueReason) -> None:
        self.requeues.labels(reason.value).inc()
        latest = self._last_report.get(worker_id)
        if latest is not None and seq_id in latest[1]:
            latest[1].discard(seq_id)
            self._leave_chain(latest[0], {seq_id})

    def on_finished(self, seq_id: int, reason: FinishReason) -> None:
        self.finished.labels(reason.name.lower()).inc()
        submitted_at = self._submitted_at.pop(seq_id, None)
        self._last_token_at.pop(seq_id, None)
        if submitted_at is not None:
            self.e2e_latency.observe(self._clock() - submitted_at)

    def on_evicted(self, seq_id: int, worker_id: str, reason: EvictReason) -> None:
        self.evictions.labels(reason.value).inc()

    def on_admission_blocked(self, worker_id: str, reason: BlockReason) -> None:
        self.admissions_blocked.labels(reason.value).inc()

    def on_placement_passed(self, worker_id: str, reason: PlacementPass) -> None:
        self.placement_passed.labels(reason.value).inc()

    def on_decision(self, report: WorkerReport, decision: Decision) -> None:
        w = report.worker_id
        series = self._decision_series.get(w)
        if series is None:
            series = self._decision_series[w] = tuple(
                metric.labels(w)
                for metric in (
                    self.worker_kv_free_pages,
                    self.worker_gdn_free_slots,
                    self.worker_running,
                    self.worker_prefilling,
                    self.worker_iterations,
                )
            )
        kv_free_pages, gdn_free_slots, running, prefilling, iterations = series
        kv_free_pages.set(report.kv_free_pages)
        gdn_free_slots.set(report.gdn_free_slots)
        running.set(len(report.running))
        prefilling.set(len(report.waiting))
        iterations.inc()
        self.decision_prefill_tokens.observe(sum(c.chunk_len for c in decision.prefill))
        self.decision_decode_sequences.observe(len(decision.decode))

    def on_worker_registered(
        self, worker_id: str, total_kv_pages: int, total_gdn_slots: int
    ) -> None:
        self.worker_kv_total_pages.labels(worker_id).set(total_kv_pages)
        self.worker_gdn_total_slots.labels(worker_id).set(total_gdn_slots)
        self.worker_iterations.labels(worker_id)
        self.worker_resume_points.labels(worker_id).set(0)  # none known at registration
        for source in ("computed", "cached"):
            self.worker_prefill_tokens.labels(worker_id, source)
        self.worker_cache_misses.labels(worker_id)
        self.worker_resume_points_removed.labels(worker_id)
        self.handoffs.worker_registered(worker_id)
        self._worker_ids.add(worker_id)
        self.workers.set(len(self._worker_ids))

    def on_worker_removed(self, worker_id: str) -> None:
        self._decision_series.pop(worker_id, None)
        latest = self._last_report.pop(worker_id, None)
        if latest is not None:
            self._leave_chain(*latest)
        for metric in self._per_worker:
            try:
                metric.remove(worker_id)
            except KeyError:
                pass  # the worker left before it ever reported
        for source in ("computed", "cached"):
            try:
                self.worker_prefill_tokens.remove(worker_id, source)
            except KeyError:
                pass
        self.handoffs.worker_removed(worker_id)
        self._worker_ids.discard(worker_id)
        self.workers.set(len(self._worker_ids))

    def on_queue_depth(self, depth: int) -> None:
        self.queue_depth.set(depth)

    def on_queue_bands(self, depth_by_band: dict[str, int]) -> None:
        for band, depth in depth_by_band.items():
            self.queue_depth_by_priority.labels(band).set(depth)

    def on_preempted(self, seq_id: int, worker_id: str, reason: PreemptReason) -> None:
        self.preemptions.labels(reason.value).inc()

    def on_plan(self, worker_id: str, num_batched_tokens: int, token_budget: int | None) -> None:
        self.decision_batched_tokens.observe(num_batched_tokens)
        if token_budget:
            self.decision_budget_used.observe(num_batched_tokens / token_budget)
            self.worker_token_budget.labels(worker_id).set(token_budget)

    def on_step_time(
        self, worker_id: str, predicted_seconds: float, measured_seconds: float
    ) -> None:
        self.worker_step_predicted.labels(worker_id).set(predicted_seconds)
        self.worker_step_measured.labels(worker_id).set(measured_seconds)
        self.step_time_error.labels(worker_id).observe(
            abs(predicted_seconds - measured_seconds) / measured_seconds
        )

    def on_step_time_refused(
        self,
        worker_id: str,
        reason: StepTimeRefusal,
        claimed_seconds: float,
        bound_seconds: float,
        first: bool,
    ) -> None:
        self.step_times_refused.labels(reason.value).inc()
        if first:  # once per worker: a broken or lying worker would flood the log
            log.warning(
                "a reported step time was not learned: it contradicts what the scheduler "
                "saw; later ones of this worker are counted in "
                "lattice_scheduler_step_times_refused_total only",
                extra={
                    "worker_id": worker_id,
                    "reason": reason.value,
                    "claimed_seconds": claimed_seconds,
                    "bound_seconds": round(bound_seconds, 6),
                },
            )

    def on_change_refused(self, num_sequences: int, reason: str) -> None:
        self.store_refusals.inc()
        log.error(
            "the state store refused a change for its data; it is not retried",
            extra={"failed_sequences": num_sequences, "reason": reason[:500]},
        )

    def on_prefill_tokens(self, worker_id: str, computed: int, cached: int) -> None:
        self.prefill_tokens.labels("computed").inc(computed)
        self.worker_prefill_tokens.labels(worker_id, "computed").inc(computed)
        if cached:
            self.prefill_tokens.labels("cached").inc(cached)
            self.worker_prefill_tokens.labels(worker_id, "cached").inc(cached)

    def on_cache_miss(self, seq_id: int, worker_id: str) -> None:
        self.cache_misses.inc()
        self.worker_cache_misses.labels(worker_id).inc()

    def on_resume_points(self, worker_id: str, num_points: int, num_removed: int) -> None:
        self.worker_resume_points.labels(worker_id).set(num_points)
        if num_removed:
            self.worker_resume_points_removed.labels(worker_id).inc(num_removed)

    def on_handoff_started(self, seq_id: int, sender: str, receiver: str) -> None:
        self.handoffs.started()

    def on_handoff(
        self,
        seq_id: int,
        sender: str,
        receiver: str,
        end: HandoffEnd,
        num_bytes: int,
        transfer_seconds: float,
    ) -> None:
        self.handoffs.ended(sender, receiver, end, num_bytes, transfer_seconds)

    def on_served(self, tenant: str, num_tokens: int) -> None:
        label = tenant if tenant in self._named_tenants else OTHER_TENANT
        self.tenant_served_tokens.labels(label).inc(num_tokens)
