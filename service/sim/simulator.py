"""A discrete-event simulation of the scheduler and its workers on a virtual clock.

The production pieces run unchanged: service.core.Scheduler with its policy, WorkerLoop
(one `iterate()` per worker iteration) and service/server/convert.py's message mapping (through
InProcessClient). Only the model is simulated (SimEngine, timed by a cost model) and time
is virtual: no gRPC, no sleeping.

Events, earliest first (at equal times arrivals first, then workers in the order their
events were made):
- an arrival submits its request (pull: to the one scheduler; routing: to the scheduler of
  the worker the router picks) and wakes idle workers;
- a worker's event is the end of its step: it reports (tokens, finishes) and gets its next
  decision in one `iterate()`, whose step ends `step_seconds` later. A worker holding
  nothing goes idle until an arrival or a requeue gives it work (the longest idle is woken
  first, as a long-poll would serve it); one holding sequences that got nothing polls
  again after IDLE_POLL_SECONDS; an idle worker calls at least every half lease. Idle
  workers are woken by arrivals and by a call that put sequences back in the queue.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from common.block_hash import block_hashes
from common.step_table import StepLoad
from service.core import (
    FinishReason,
    Scheduler,
    SchedulerConfig,
    SchedulerObserver,
    SubmitParams,
    WorkerReport,
)
from service.core.decide.handoff import HandoffInput, choose_handoff
from service.sim.client import InProcessClient
from service.sim.engine import CostModel, SimEngine
from service.sim.routing import CACHE_ROUTINGS, ROUTINGS, make_router
from service.sim.transfer import HANDOFF_TOKEN, HandoffCounts, Roles, TransferModel
from service.sim.workload import Request, prompt_token_ids
from worker_client.loop import WorkerLoop
from worker_client.resources import WorkerResources

# WorkerLoop's default pause after an iteration with nothing to run.
IDLE_POLL_SECONDS = 0.01
# No step is shorter than this: keeps a zero-cost step from looping at one instant.
MIN_STEP_SECONDS = 1e-6
# Virtual seconds without any token, admission or finish (and no arrival left) after which
# a run is declared stuck.
STALL_SECONDS = 3600.0
_ARRIVAL, _WORKER, _HANDOFF = 0, 1, 2
# With roles, the schedulers' indexes: decode workers (and co-located requests), prefill.
_DECODE_POOL, _PREFILL_POOL = 0, 1


class SimulationStalled(RuntimeError):
    """Requests that can never finish (e.g. a prompt larger than a worker's KV pool)."""


@dataclass(frozen=True)
class WorkerShape:
    """The resources every simulated worker registers with."""

    total_kv_pages: int
    page_size: int
    total_gdn_slots: int
    max_batch_size: int = 0  # 0: the scheduler's --max-batch-size
    cache_block_tokens: int = 0  # tokens per prefix-cache block; 0: no prefix cache
    # GDN snapshot slots of a hybrid model (a resume point needs one); None: a model
    # without GDN layers, every cached block is a resume point.
    snapshot_slots: int | None = None


@dataclass(frozen=True)
class RunSpec:
    """One simulation: the scheduler's settings, the fleet and how requests reach it."""

    scheduler: SchedulerConfig
    worker: WorkerShape
    num_workers: int
    routing: str = "pull"
    # Each worker's speed relative to the cost model (2: steps take half as long); empty:
    # all 1. A mixed fleet: --worker-speeds 1,1,0.5,0.5.
    worker_speeds: tuple[float, ...] = ()
    seed: int = 0  # of the routers' tie-breaks
    # A prefill/decode split (None: every worker runs both) and how handoffs move.
    roles: Roles | None = None
    transfer: TransferModel = field(default_factory=TransferModel)

    def __post_init__(self) -> None:
        if self.roles is not None:
            if self.routing != "pull":
                raise ValueError("--roles needs --routing pull (one queue per role)")
            if self.roles.num_prefill + self.roles.num_decode != self.num_workers:
                raise ValueError(f"--roles {self.roles.name} does not make {self.num_workers}")
        if self.num_workers < 1:
            raise ValueError(f"--workers must be at least 1, got {self.num_workers}")
        if self.worker_speeds and len(self.worker_speeds) != self.num_workers:
            raise ValueError(
                f"--worker-speeds lists {len(self.worker_speeds)} speeds for "
                f"{self.num_workers} workers: give one per worker"
            )
        if any(not speed > 0 for speed in self.worker_speeds):
            raise ValueError(f"--worker-speeds must all be above 0, got {self.worker_speeds}")
        if self.routing not in ROUTINGS:
            raise ValueError(
                f"--routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}"
            )


@dataclass
class RequestRecord:
    """What happened to one request, in virtual seconds."""

    request: Request
    admitted_at: float | None = None  # first admission
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    num_tokens: int = 0
    finish_reason: FinishReason | None = None
    num_finishes: int = 0
    worker_id: str = ""  # of its latest admission


@dataclass
class RunOutcome:
    """Every request's record and the run's counts."""

    records: list[RequestRecord]
    engine_preemptions: int
    scheduler_preemptions: int
    num_iterations: int
    num_steps: int
    end_seconds: float
    # Per worker id, |predicted - measured| / measured of every step time the scheduler
    # learned from, in order (empty without a latency target).
    step_time_errors: dict[str, list[float]] = field(default_factory=dict)
    # Prefill work: prompt tokens the workers computed, and those they resumed from a
    # prefix cache instead; first chunks whose resume point was gone.
    computed_prefill_tokens: int = 0
    cached_prefill_tokens: int = 0
    cache_misses: int = 0
    worker_ids: tuple[str, ...] = ()
    handoffs: HandoffCounts | None = None  # with roles


@dataclass
class _Worker:
    index: int
    loop: WorkerLoop
    engine: SimEngine
    scheduler_index: int
    generation: int = 0  # events of older generations are stale


class _Scaled:
    """A cost model whose every step takes `factor` times as long."""

    def __init__(self, model: CostModel, factor: float) -> None:
        self._model = model
        self._factor = factor

    def step_seconds(self, load) -> float:
        return self._model.step_seconds(load) * self._factor


class _Recorder(SchedulerObserver):
    """Stamps what one scheduler reports with the virtual clock."""

    def __init__(
        self,
        now: Callable[[], float],
        on_progress: Callable[[], None],
        on_finish: Callable[[RequestRecord], None],
    ) -> None:
        self.by_seq_id: dict[int, RequestRecord] = {}
        self.queue_depth = 0
        self.step_time_errors: dict[str, list[float]] = {}
        self._now = now
        self._on_progress = on_progress
        self._on_finish = on_finish

    def on_tokens(self, seq_id: int, num_tokens: int) -> None:
        record = self.by_seq_id[seq_id]
        now = self._now()
        if record.first_token_at is None:
            record.first_token_at = now
        record.last_token_at = now
        record.num_tokens += num_tokens
        self._on_progress()

    def on_admitted(self, seq_id: int, worker_id: str, queue_wait_seconds: float) -> None:
        record = self.by_seq_id[seq_id]
        record.worker_id = worker_id
        if record.admitted_at is None:
            record.admitted_at = self._now()
        self._on_progress()

    def on_finished(self, seq_id: int, reason: FinishReason) -> None:
        record = self.by_seq_id[seq_id]
        record.finished_at = self._now()
        record.finish_reason = reason
        record.num_finishes += 1
        self._on_progress()
        self._on_finish(record)

    def on_queue_depth(self, depth: int) -> None:
        self.queue_depth = depth

    def on_step_time(
        self, worker_id: str, predicted_seconds: float, measured_seconds: float
    ) -> None:
        self.step_time_errors.setdefault(worker_id, []).append(
            abs(predicted_seconds - measured_seconds) / measured_seconds
        )


class _PrefillRecorder(_Recorder):
    """A prefill worker's scheduler: a sequence that ends there with tokens still to
    generate is handed off (`on_prefilled`), not finished."""

    def __init__(self, *args, on_prefilled: Callable[[int, RequestRecord], None]) -> None:
        super().__init__(*args)
        self._on_prefilled = on_prefilled

    def on_finished(self, seq_id: int, reason: FinishReason) -> None:
        record = self.by_seq_id[seq_id]
        if reason is FinishReason.MAX_LENGTH and record.num_tokens < record.request.output_len:
            self._on_prefilled(seq_id, record)
        else:
            super().on_finished(seq_id, reason)


class Simulation:
    """Runs `requests` through `spec`'s fleet; `run()` once."""

    def __init__(
        self,
        spec: RunSpec,
        cost_model: CostModel,
        requests: list[Request],
        *,
        on_finish: Callable[[], None] | None = None,
    ) -> None:
        self.spec = spec
        self.now = 0.0
        self._requests = requests
        self._records = [RequestRecord(r) for r in requests]
        self._last_progress = 0.0
        self._num_finished = 0
        self._num_arrivals_left = len(requests)
        self._on_finish_hook = on_finish or (lambda: None)
        num_schedulers = 1 if spec.routing == "pull" else spec.num_workers
        self._recorders = [
            _Recorder(self._clock, self._progress, self._finished) for _ in range(num_schedulers)
        ]
        self._cost_model = cost_model
        self._imports: dict[int, int] = {}  # handed-off context by stand-in token (engine)
        self._handoffs = HandoffCounts() if spec.roles else None
        # The rule's settings: a handoff adds at most one TPOT target before the second token.
        tpot_seconds = spec.scheduler.tpot_target_ms / 1000.0
        rule = spec.transfer.rule
        self._rule = (
            replace(rule, max_transfer_seconds=min(rule.max_transfer_seconds, tpot_seconds))
            if tpot_seconds > 0
            else rule
        )
        # Prefill seconds of each handed-off request not yet prefilled, by request index.
        self._prefill_outstanding: dict[int, float] = {}
        if spec.roles:
            self._recorders.append(
                _PrefillRecorder(
                    self._clock, self._progress, self._finished, on_prefilled=self._prefilled
                )
            )
        self._schedulers = [
            Scheduler(config, clock=self._clock, observer=recorder)
            for config, recorder in zip(self._pool_configs(), self._recorders, strict=True)
        ]
        self._clients = [InProcessClient(s, on_report=self._on_report) for s in self._schedulers]
        self._workers = [self._make_worker(i, cost_model) for i in range(spec.num_workers)]
        self._index_of = {w.loop.resources.worker_id: w.index for w in self._workers}
        self._idle: dict[int, None] = {}  # idle worker indexes, longest idle first
        self._router = None if spec.routing == "pull" else make_router(spec.routing, spec.seed)
        self._fleet = _Fleet(self)
        self._events: list[tuple[float, int, int, int, int]] = []
        self._order = itertools.count()

    def run(self) -> RunOutcome:
        for worker in self._workers:
            worker.loop.register()  # as `run` does: it learns the packed token form too
            self._go_idle(worker)
        for request in self._requests:
            self._push(request.arrival_seconds, _ARRIVAL, request.index)
        while self._events and self._num_finished < len(self._requests):
            time, kind, _, index, generation = heapq.heappop(self._events)
            self.now = max(self.now, time)
            if kind == _ARRIVAL:
                self._num_arrivals_left -= 1
                self._arrive(self._requests[index])
            elif kind == _HANDOFF:
                self._handed_off(self._requests[index])
            elif generation == self._workers[index].generation:
                self._work(self._workers[index])
            self._check_stall()
        if self._num_finished < len(self._requests):
            self._stalled()
        for worker in self._workers:
            worker.loop.client.deregister(worker.loop.resources.worker_id)
        return RunOutcome(
            records=self._records,
            engine_preemptions=sum(c.counts.engine_preemptions for c in self._clients),
            scheduler_preemptions=sum(c.counts.scheduler_preemptions for c in self._clients),
            num_iterations=sum(w.loop.stats.iterations for w in self._workers),
            num_steps=sum(w.engine.num_steps for w in self._workers),
            end_seconds=self.now,
            step_time_errors={w: e for r in self._recorders for w, e in r.step_time_errors.items()},
            computed_prefill_tokens=sum(
                w.engine.num_computed_prefill_tokens for w in self._workers
            ),
            cached_prefill_tokens=sum(
                w.engine.prefix_cache.num_resumed_tokens
                for w in self._workers
                if w.engine.prefix_cache
            ),
            cache_misses=sum(c.counts.cache_misses for c in self._clients),
            worker_ids=tuple(w.loop.resources.worker_id for w in self._workers),
            handoffs=self._handoff_counts(),
        )

    # Events.

    def _arrive(self, request: Request) -> None:
        token_ids = prompt_token_ids(request)
        worker_index = self._route(request, token_ids)
        scheduler_index = 0 if worker_index is None else worker_index
        max_new_tokens = request.output_len
        if self.spec.roles and self._hand_off(request, token_ids):
            # The prefill worker computes the prompt and the first token, then hands off.
            scheduler_index, max_new_tokens = _PREFILL_POOL, 1
        result = self._schedulers[scheduler_index].submit(
            SubmitParams(
                prompt_token_ids=token_ids,
                max_new_tokens=max_new_tokens,
                request_id=f"r{request.index}",
            )
        )
        self._recorders[scheduler_index].by_seq_id[result.seq_id] = self._records[request.index]
        self._last_progress = self.now
        self._wake_idle(scheduler_index)

    def _work(self, worker: _Worker) -> None:
        recorder = self._recorders[worker.scheduler_index]
        steps_before, depth_before = worker.engine.num_steps, recorder.queue_depth
        ran = worker.loop.iterate()
        if worker.engine.num_steps > steps_before:
            step_seconds = max(MIN_STEP_SECONDS, worker.engine.last_step_seconds)
            self._schedule(worker, self.now + step_seconds)
        elif ran:  # re-registered: call again at once
            self._schedule(worker, self.now + MIN_STEP_SECONDS)
        elif worker.engine.waiting_ids() or worker.engine.running_ids():
            self._schedule(worker, self.now + IDLE_POLL_SECONDS)
        else:
            self._go_idle(worker)
        if recorder.queue_depth > depth_before:  # requeued work: idle workers may take it
            self._wake_idle(worker.scheduler_index)

    # Handoffs.

    def _hand_off(self, request: Request, token_ids: tuple[int, ...]) -> bool:
        """The core's rule (service/core/decide/handoff.py) on this request, against the
        decode workers' mean load and their caches."""
        transfer, counts = self.spec.transfer, self._handoffs
        decoders = [w for w in self._workers if w.scheduler_index == _DECODE_POOL]
        # Per decode worker, rounded up: any decode running makes the pool busy.
        num_decoding = -(-sum(len(w.engine.running_ids()) for w in decoders) // len(decoders))
        cached = 0
        if self.spec.worker.cache_block_tokens:
            fleet = self._fleet
            hashes = block_hashes(token_ids[:-1], "", fleet.block_tokens)
            cached = fleet.block_tokens * max(
                fleet.cached_blocks(w.index, hashes) for w in decoders
            )
        prefill_seconds = self._prefill_seconds(cached, request.prompt_len)
        outstanding = self._prefill_outstanding
        choice = choose_handoff(
            HandoffInput(
                prompt_tokens=request.prompt_len,
                cached_tokens=cached,
                prefill_seconds=prefill_seconds,
                num_decoding=num_decoding,
                transfer_bytes_per_second=transfer.bytes_per_second,
                prefill_wait_seconds=sum(outstanding.values()) / self.spec.roles.num_prefill,
            ),
            transfer.shape,
            self._rule,
        )
        counts.reasons[choice.reason.value] = counts.reasons.get(choice.reason.value, 0) + 1
        if choice.handoff:
            outstanding[request.index] = prefill_seconds
        else:
            counts.num_colocated += 1
        return choice.handoff

    def _prefill_seconds(self, start: int, end: int) -> float:
        """Prompt tokens [start, end) alone on a worker, in chunks of chunk_size."""
        chunk = self.spec.scheduler.chunk_size
        return sum(
            self._cost_model.step_seconds(StepLoad(((min(chunk, end - s), s),), ()))
            for s in range(start, end, chunk)
        )

    def _prefilled(self, seq_id: int, record: RequestRecord) -> None:
        """A prefill worker finished a prompt and its first token: the transfer starts."""
        request, counts = record.request, self._handoffs
        self._prefill_outstanding.pop(request.index, None)
        num_bytes = self.spec.transfer.shape.handoff_bytes(request.prompt_len + 1)
        seconds = self.spec.transfer.seconds(num_bytes)
        counts.num_handoffs += 1
        counts.num_bytes += num_bytes
        counts.transfer_seconds += seconds
        self._push(self.now + seconds, _HANDOFF, request.index)

    def _handed_off(self, request: Request) -> None:
        """The transfer is done: the decode workers' queue takes the sequence, whose
        stand-in prompt (its first token) the engine that admits it maps to the context."""
        token = HANDOFF_TOKEN + request.index
        self._imports[token] = request.prompt_len
        result = self._schedulers[_DECODE_POOL].submit(
            SubmitParams(
                prompt_token_ids=(token,),
                max_new_tokens=request.output_len - 1,
                request_id=f"h{request.index}",
            )
        )
        self._recorders[_DECODE_POOL].by_seq_id[result.seq_id] = self._records[request.index]
        self._last_progress = self.now
        self._wake_idle(_DECODE_POOL)

    def _pool_configs(self) -> list[SchedulerConfig]:
        """Each scheduler's config; a prefill pool's has no TPOT target: it runs no decode,
        so nothing holds its steps short (its prompts still go earliest deadline first)."""
        configs = [self.spec.scheduler] * len(self._recorders)
        if self.spec.roles:
            configs[_PREFILL_POOL] = replace(self.spec.scheduler, tpot_target_ms=0.0)
        return configs

    def _handoff_counts(self) -> HandoffCounts | None:
        if self._handoffs is not None:
            self._handoffs.num_receiver_preemptions = sum(
                w.engine.num_imports_resumed for w in self._workers
            )
        return self._handoffs

    # Workers.

    def _make_worker(self, index: int, cost_model: CostModel) -> _Worker:
        shape = self.spec.worker
        speed = self.spec.worker_speeds[index] if self.spec.worker_speeds else 1.0
        if speed != 1.0:
            cost_model = _Scaled(cost_model, 1.0 / speed)
        engine = SimEngine(
            cost_model,
            total_kv_pages=shape.total_kv_pages,
            page_size=shape.page_size,
            total_gdn_slots=shape.total_gdn_slots,
            cache_block_tokens=shape.cache_block_tokens,
            snapshot_slots=shape.snapshot_slots,
            imports=self._imports,
        )
        scheduler_index = 0 if self.spec.routing == "pull" else index
        if self.spec.roles and index < self.spec.roles.num_prefill:
            scheduler_index = _PREFILL_POOL
        resources = WorkerResources.of(f"sim-{index}", engine, shape.max_batch_size)
        loop = WorkerLoop(
            engine, self._clients[scheduler_index], resources, idle_sleep_seconds=IDLE_POLL_SECONDS
        )
        return _Worker(index, loop, engine, scheduler_index)

    def _schedule(self, worker: _Worker, time: float, *, idle: bool = False) -> None:
        """Make `time` the worker's next event (its earlier one goes stale)."""
        worker.generation += 1
        if idle:
            self._idle[worker.index] = None
        else:
            self._idle.pop(worker.index, None)
        self._push(time, _WORKER, worker.index, worker.generation)

    def _go_idle(self, worker: _Worker) -> None:
        """Wait for work; call at least every half lease so the lease never runs out."""
        self._schedule(worker, self.now + self.spec.scheduler.lease_ttl_ms / 2000.0, idle=True)

    def _wake_idle(self, scheduler_index: int) -> None:
        for index in list(self._idle):
            worker = self._workers[index]
            if worker.scheduler_index == scheduler_index:
                self._schedule(worker, self.now)

    def _route(self, request: Request, token_ids: tuple[int, ...]) -> int | None:
        """The worker whose queue takes the request; None for the pull design."""
        if self._router is None:
            return None
        fleet = self._fleet
        hashes: list[int] = []
        if self.spec.routing in CACHE_ROUTINGS and self.spec.worker.cache_block_tokens:
            # Full blocks strictly below the prompt's end: a first chunk computes one token at least.
            hashes = block_hashes(token_ids[:-1], "", fleet.block_tokens)
        index = self._router.pick(fleet, request.prompt_len, hashes)
        uncached = request.prompt_len - fleet.cached_blocks(index, hashes) * fleet.block_tokens
        fleet.owned[index][request.index] = uncached
        fleet.owner[request.index] = index
        return index

    def _on_report(self, report: WorkerReport) -> None:
        """A worker's cache events reach the routers' view as they reach its scheduler."""
        cache = report.cache
        if cache.added or cache.removed or cache.reset:
            points = self._fleet.points[self._index_of[report.worker_id]]
            if cache.reset:
                points.clear()
            points.difference_update(cache.removed)
            points.update(cache.added)

    # Bookkeeping.

    def _push(self, time: float, kind: int, index: int, generation: int = 0) -> None:
        heapq.heappush(self._events, (time, kind, next(self._order), index, generation))

    def _clock(self) -> float:
        return self.now

    def _progress(self) -> None:
        self._last_progress = self.now

    def _finished(self, record: RequestRecord) -> None:
        self._num_finished += 1
        self._prefill_outstanding.pop(record.request.index, None)
        owner = self._fleet.owner.get(record.request.index)
        if owner is not None:
            self._fleet.owned[owner].pop(record.request.index, None)
        self._on_finish_hook()

    def _check_stall(self) -> None:
        if self._num_arrivals_left == 0 and self.now - self._last_progress > STALL_SECONDS:
            self._stalled()

    def _stalled(self) -> None:
        stuck = [r for r in self._records if r.finished_at is None]
        worst = max(stuck, key=lambda r: r.request.prompt_len + r.request.output_len)
        raise SimulationStalled(
            f"{len(stuck)} of {len(self._records)} requests made no progress for "
            f"{STALL_SECONDS:.0f} simulated seconds (e.g. request {worst.request.index}: "
            f"prompt {worst.request.prompt_len} + output {worst.request.output_len} tokens); "
            f"a worker has {self.spec.worker.total_kv_pages} KV pages of "
            f"{self.spec.worker.page_size} tokens: check --kv-pages and the policy's limits"
        )


class _Fleet:
    """routing.FleetView over a simulation's workers: their reported resume points and
    what the router tracks of the requests it routed."""

    def __init__(self, sim: Simulation) -> None:
        shape = sim.spec.worker
        self.num_workers = sim.spec.num_workers
        self.block_tokens = shape.cache_block_tokens or shape.page_size
        self.points: list[set[int]] = [set() for _ in range(self.num_workers)]
        # Per worker, its outstanding requests: index -> prompt tokens it had to compute.
        self.owned: list[dict[int, int]] = [{} for _ in range(self.num_workers)]
        self.owner: dict[int, int] = {}  # request index -> worker
        self._sim = sim

    def cached_blocks(self, w: int, hashes) -> int:
        points = self.points[w]
        for i in range(len(hashes) - 1, -1, -1):  # the longest resume point, as the core's lookup
            if hashes[i] in points:
                return i + 1
        return 0

    def num_outstanding(self, w: int) -> int:
        return len(self.owned[w])

    def num_waiting(self, w: int) -> int:
        return self._sim._recorders[w].queue_depth

    def kv_usage(self, w: int) -> float:
        engine = self._sim._workers[w].engine
        return 1.0 - engine.kv_free_pages() / engine.total_kv_pages

    def active_blocks(self, w: int) -> int:
        records, b = self._sim._records, self.block_tokens
        return sum(
            -(-(records[i].request.prompt_len + records[i].num_tokens) // b) for i in self.owned[w]
        )

    def active_prefill_tokens(self, w: int) -> int:
        records = self._sim._records
        return sum(
            uncached for i, uncached in self.owned[w].items() if records[i].first_token_at is None
        )
