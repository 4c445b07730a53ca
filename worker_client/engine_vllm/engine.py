"""`VllmEngine`: the `Engine` protocol over an in-process vLLM `EngineCore`.

Each `step` turns the Lattice decision into a plan {request id: tokens} for
`PlannedScheduler`, steps vLLM once, and checks that vLLM scheduled exactly the plan.

Refusals. Before a step, a chunk vLLM could not run exactly is refused: a continuation
whose start is not where vLLM's prefill stands, a chunk that crosses a block boundary
without starting and ending on one while vLLM aligns chunks (prefix caching on a hybrid
model), a
first chunk whose `cached_tokens` is not what vLLM's cache would give it, a step over
vLLM's token or sequence limits. After a step, a sequence whose scheduled tokens differ
from the plan, or that vLLM preempted on its own, is refused too: its tokens of that step
are dropped. A refused sequence is dropped from vLLM and reported in
`StepOutput.preempted`, so the Lattice scheduler requeues it (nothing is lost, nothing runs
other than decided), and the worker says why in one log line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from worker_client.engine.api import (
    CacheDelta,
    ChunkWork,
    FinishedSequence,
    FinishReason,
    SequenceSpec,
    StepOutput,
    TokenLogprobs,
)

from .books import PoolBooks, ResumePoints
from .environment import import_vllm
from .generators import keep_dropped_draws
from .settings import VllmSettings

log = logging.getLogger(__name__)


@dataclass
class _Held:
    seq_id: int
    request: object  # vllm.v1.request.Request
    num_generated: int = 0
    contract_hashes: list[int] = field(default_factory=list)  # h_0.. of its computed blocks

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prefilled(self) -> bool:
        return self.request.num_computed_tokens >= self.request.num_prompt_tokens


@dataclass
class StepStats:
    """What the engine ran, summed over its life (the worker prints it when it leaves)."""

    num_steps: int = 0  # vLLM steps run (a decision with nothing to run is no step)
    num_chunks: int = 0  # prefill chunks run
    num_prefill_tokens: int = 0
    num_decodes: int = 0
    step_seconds: float = 0.0  # wall time inside vLLM's step
    step_cpu_seconds: float = 0.0  # CPU time of the stepping thread inside vLLM's step
    # CPU time of `VllmEngine.step` around vLLM's step: planning, checks, resume points
    adapter_cpu_seconds: float = 0.0

    def line(self) -> str:
        per_step = (self.num_prefill_tokens + self.num_decodes) / max(1, self.num_steps)
        adapter_ms = self.adapter_cpu_seconds * 1000 / max(1, self.num_steps)
        return (
            f"vLLM steps {self.num_steps} in {self.step_seconds:.2f} s "
            f"({self.step_cpu_seconds:.2f} s CPU), "
            f"{per_step:.1f} tokens a step; {self.num_chunks} prefill chunks of "
            f"{self.num_prefill_tokens} tokens; {self.num_decodes} decodes; "
            f"{adapter_ms:.2f} ms of CPU a step around it"
        )


class Refused(Exception):
    """A chunk or decode vLLM would not run exactly as decided; the message says why."""


class Invalid(Exception):
    """A sequence vLLM will not take at all (its prompt past max_model_len, say): it
    fails, with vLLM's words."""


class VllmEngine:
    """Implements worker_client.engine.api.Engine with vLLM (module docstring)."""

    def __init__(self, settings: VllmSettings) -> None:
        vllm = import_vllm()
        from .scheduler import PlannedScheduler

        self.settings = settings
        kwargs = dict(
            model=settings.model,
            dtype=settings.dtype,
            enforce_eager=settings.enforce_eager,
            enable_prefix_caching=settings.prefix_caching,
            tensor_parallel_size=settings.tensor_parallel_size,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            scheduler_cls=PlannedScheduler,
            async_scheduling=False,
            seed=settings.seed,
        )
        optional = dict(
            max_model_len=settings.max_model_len,
            kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            num_gpu_blocks_override=settings.num_blocks,
            block_size=settings.block_size,
        )
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        self._llm = vllm.LLM(**kwargs)
        # Seeded sampling after a partial chunk, on a CPU (generators.py).
        rewinds = self._llm.collective_rpc(keep_dropped_draws)
        log.info("seeded draws of dropped samples restored on CPU: %s", rewinds)
        self._sampling_params = vllm.SamplingParams
        from vllm.v1.request import RequestStatus

        self._aborted = RequestStatus.FINISHED_ABORTED
        self._core = self._llm.llm_engine.engine_core.engine_core
        self._input_processor = self._llm.llm_engine.input_processor
        scheduler = self._core.scheduler
        if not isinstance(scheduler, PlannedScheduler):
            raise RuntimeError("vLLM did not take the planned scheduler (scheduler_cls)")
        self._scheduler: PlannedScheduler = scheduler
        self._manager = scheduler.kv_cache_manager
        self._pool = self._manager.block_pool
        cache_config = scheduler.cache_config
        groups = scheduler.kv_cache_config.kv_cache_groups
        mamba_groups = [
            i for i, g in enumerate(groups) if type(g.kv_cache_spec).__name__ == "MambaSpec"
        ]
        self._mamba_group_ids = mamba_groups
        self._aligned = bool(mamba_groups) and scheduler.need_mamba_block_aligned_split
        self._books = PoolBooks(
            num_usable_blocks=self._pool.num_gpu_blocks - 1,
            num_mamba_groups=len(mamba_groups),
            blocks_per_state=2 if self._aligned else 1,
            total_gdn_slots=settings.max_num_seqs if mamba_groups else 0,
        )
        self.page_size = cache_config.block_size
        self.total_kv_pages = self._books.total_kv_pages
        if self.total_kv_pages < 1:
            raise RuntimeError(
                f"vLLM's pool of {self._pool.num_gpu_blocks} blocks leaves no KV page after "
                f"{self._books.total_gdn_slots} GDN slots of {self._books.blocks_per_slot} "
                f"blocks: give it more memory or lower --max-num-seqs"
            )
        self.total_gdn_slots = self._books.total_gdn_slots
        self.cache_block_tokens = self.page_size if settings.prefix_caching else 0
        # A resume point's GDN states (one block of each Mamba group) come out of the same
        # pool as pages: at most as many as the pool holds.
        self.total_snapshot_slots = (
            self._books.num_usable_blocks // len(mamba_groups)
            if settings.prefix_caching and mamba_groups
            else 0
        )
        max_points = self.total_kv_pages  # a block per page (cache_block_tokens = page_size)
        if self.total_snapshot_slots:
            max_points = min(max_points, self.total_snapshot_slots)
        self._resume_points = (
            ResumePoints(self.page_size, scheduler.hash_block_size, max_points)
            if settings.prefix_caching
            else None
        )
        self._max_tokens_per_step = scheduler.max_num_scheduled_tokens
        self._evicted = True  # whether vLLM dropped cached blocks since the last delta
        self._note_evictions()
        # Registered: the scheduler's token budget for this worker is at most vLLM's own
        # (and vLLM's when none is configured), so no decision is refused for its size.
        self.max_step_tokens = self._max_tokens_per_step
        self._held: dict[int, _Held] = {}
        self._next_request = 0
        self.num_refused = 0  # sequences refused, before or after a step
        self.stats = StepStats()

    # ------------------------------------------------------------------ reports

    def kv_free_pages(self) -> int:
        held = 0
        managers = self._manager.coordinator.single_type_managers
        for group in self._mamba_group_ids:
            blocks = managers[group].req_to_blocks
            for h in self._held.values():
                held += sum(1 for b in blocks.get(h.request_id, ()) if not b.is_null)
        return self._books.kv_free_pages(self._pool.get_num_free_blocks(), held)

    def kv_cached_pages(self) -> int:
        if self._resume_points is None:
            return 0
        # Asked once per iteration before each step: walk the cached blocks only, not the
        # whole pool (8,192 blocks for 1 GiB of the bench's model: about 1 ms a call).
        free_cached = set()  # block ids: a block may be cached under several hashes
        for entry in self._pool.cached_block_hash_to_block._cache.values():
            for block in entry.values() if isinstance(entry, dict) else (entry,):
                if block.ref_cnt == 0:
                    free_cached.add(block.block_id)
        return min(len(free_cached), self.kv_free_pages())

    def gdn_free_slots(self) -> int:
        return max(0, self.total_gdn_slots - len(self._held))

    def cache_delta(self, full: bool = False) -> CacheDelta:
        if self._resume_points is None:
            return CacheDelta(reset=full)
        coordinator = self._manager.coordinator

        def hit_length(vllm_hashes, num_tokens: int) -> int:
            return coordinator.find_longest_cache_hit(vllm_hashes, num_tokens)[1]

        evicted, self._evicted = self._evicted, False
        return self._resume_points.delta(hit_length, full, evicted)

    def _note_evictions(self) -> None:
        """Have vLLM's pool tell us when it drops a cached block (it does so only as it
        reuses a free block, or when asked to): until then no resume point can be lost."""
        pool, drop = self._pool, self._pool._maybe_evict_cached_block

        def dropping(block) -> bool:
            dropped = drop(block)
            self._evicted = self._evicted or dropped
            return dropped

        pool._maybe_evict_cached_block = dropping

    def waiting_ids(self) -> list[int]:
        return [s for s, h in self._held.items() if not h.prefilled]

    def running_ids(self) -> list[int]:
        return [s for s, h in self._held.items() if h.prefilled]

    # Handoffs: not supported (vLLM's KV connectors would move it; not built (docs/disaggregation.md)).
    # lattice-worker refuses --role prefill and decode for it.
    can_hand_off = False
    handoff_bytes_per_token = 0.0
    handoff_fixed_bytes = 0.0

    def export_sequence(self, seq_id: int, first_token: int = 0):
        raise NotImplementedError("VllmEngine cannot hand sequences off")

    def import_sequence(self, seq_id, spec, chunks, cached_tokens: int = 0) -> None:
        raise NotImplementedError("VllmEngine cannot hand sequences off")

    def evict(self, seq_ids: Iterable[int]) -> None:
        gone = [self._held.pop(s) for s in seq_ids if s in self._held]
        if gone:
            self._scheduler.finish_requests([h.request_id for h in gone], self._aborted)

    # ------------------------------------------------------------------ step

    def step(self, prefill: Sequence[ChunkWork], decode: Sequence[int]) -> StepOutput:
        cpu_started, inside_before = time.thread_time(), self.stats.step_cpu_seconds
        try:
            return self._step(prefill, decode)
        finally:
            inside = self.stats.step_cpu_seconds - inside_before
            self.stats.adapter_cpu_seconds += time.thread_time() - cpu_started - inside

    def _step(self, prefill: Sequence[ChunkWork], decode: Sequence[int]) -> StepOutput:
        plan: dict[str, int] = {}
        refused: list[int] = []
        misses: list[int] = []
        failed: list[FinishedSequence] = []
        for chunk in prefill:
            if chunk.spec is None and chunk.seq_id not in self._held:
                continue  # it ended or was handed back in the step before: no token
            try:
                request_id = self._plan_chunk(chunk)
            except Refused as why:
                self._refuse(chunk.seq_id, str(why), refused)
                continue
            except Invalid as why:
                failed.append(FinishedSequence(chunk.seq_id, FinishReason.FAILED, 0, str(why)))
                continue
            if request_id is None:
                misses.append(chunk.seq_id)
            else:
                plan[request_id] = chunk.chunk_len
        for seq_id in decode:
            held = self._held.get(seq_id)
            # A sequence that ended in the step before may be scheduled once more: no token.
            if held is not None and held.prefilled:
                plan[held.request_id] = 1
        self._fit_limits(plan, refused)
        out = self._run(plan)
        return StepOutput(
            tokens=out.tokens,
            finished=(*failed, *out.finished),
            preempted=(*refused, *out.preempted),
            cache_misses=tuple(misses),
            logprobs=out.logprobs,
        )

    def _plan_chunk(self, chunk: ChunkWork) -> str | None:
        """The request id that runs `chunk`; None for a cache miss (nothing held)."""
        end = chunk.chunk_start + chunk.chunk_len
        if chunk.spec is None:
            held = self._held[chunk.seq_id]
            computed = held.request.num_computed_tokens
            if chunk.chunk_start != computed:
                raise Refused(
                    f"chunk starts at token {chunk.chunk_start}, vLLM's prefill stands at "
                    f"{computed}"
                )
            self._check_alignment(chunk.chunk_start, end)
            return held.request_id
        if chunk.seq_id in self._held:
            raise Refused("a first chunk of a sequence this worker already holds")
        if chunk.chunk_start != chunk.cached_tokens:
            raise Refused(
                f"first chunk starts at {chunk.chunk_start}, not at cached_tokens "
                f"{chunk.cached_tokens}"
            )
        prompt_len = len(chunk.spec.prompt_token_ids)
        if end > prompt_len:
            raise Refused(f"chunk ends at {end}, past the prompt's {prompt_len} tokens")
        self._check_alignment(chunk.chunk_start, end)
        try:
            request = self._request(chunk.seq_id, chunk.spec, chunk.cached_tokens)
        except Exception as err:  # vLLM's validation errors are of many kinds
            raise Invalid(f"vLLM does not take it: {str(err).splitlines()[0]}") from err
        if chunk.cached_tokens:
            hit = self._manager.get_computed_blocks(request)[1]
            if hit < chunk.cached_tokens:
                return None  # the resume point is gone: a cache miss
            if hit > chunk.cached_tokens:
                raise Refused(
                    f"vLLM's cache holds {hit} of its prompt tokens, the decision "
                    f"took {chunk.cached_tokens}"
                )
        self._core.add_request(request)
        self._held[chunk.seq_id] = _Held(chunk.seq_id, request)
        return request.request_id

    def _check_alignment(self, start: int, end: int) -> None:
        """vLLM's align rule (prefix caching on a hybrid model): a chunk that crosses a
        block boundary starts and ends on one, so that each boundary's GDN state is
        written; a chunk inside one block (a prompt's tail, or a budget's remainder) runs
        as vLLM runs a block wider than its budget."""
        block = self.page_size
        crosses = (start // block + 1) * block < end
        if self._aligned and crosses and (start % block or end % block):
            raise Refused(
                f"chunk [{start}, {end}) crosses a block boundary off the boundaries: "
                f"vLLM writes GDN states at block boundaries (prefix caching on a hybrid "
                f"model), so a chunk that crosses one starts and ends at multiples of {block}"
            )

    def _request(self, seq_id: int, spec: SequenceSpec, cached_tokens: int):
        self._next_request += 1
        sampling = self._sampling_params(
            n=1,
            temperature=spec.temperature,
            top_p=spec.top_p if 0 < spec.top_p <= 1 else 1.0,
            top_k=spec.top_k if spec.top_k > 0 else 0,
            seed=spec.seed if spec.temperature > 0 else None,
            max_tokens=spec.max_new_tokens,
            min_tokens=spec.min_new_tokens,
            stop_token_ids=list(spec.stop_token_ids),
            ignore_eos=spec.ignore_eos,
            logprobs=spec.logprobs or None,
            skip_reading_prefix_cache=not cached_tokens,
            detokenize=False,
        )
        core_request = self._input_processor.process_inputs(
            f"{seq_id}.{self._next_request}",
            {"prompt_token_ids": list(spec.prompt_token_ids)},
            sampling,
            ("generate",),
        )
        return self._core.preprocess_add_request(core_request)[0]

    def _fit_limits(self, plan: dict[str, int], refused: list[int]) -> None:
        """Refuse the last planned sequences past vLLM's token or sequence limits, prefill
        chunks before decodes (a refused decode recomputes all its tokens when it comes
        back; a refused chunk only what it had prefilled)."""
        by_request = {h.request_id: h.seq_id for h in self._held.values()}
        num_tokens = num_kept = 0
        for request_id, tokens in sorted(plan.items(), key=lambda item: item[1] > 1):
            if (
                num_tokens + tokens <= self._max_tokens_per_step
                and num_kept < self.settings.max_num_seqs
            ):
                num_tokens += tokens
                num_kept += 1
            else:
                del plan[request_id]
                self._refuse(
                    by_request[request_id],
                    f"the step would pass vLLM's limits ({self._max_tokens_per_step} tokens, "
                    f"{self.settings.max_num_seqs} sequences)",
                    refused,
                )

    def _refuse(self, seq_id: int, why: str, refused: list[int]) -> None:
        self.num_refused += 1
        log.error(
            "vLLM cannot run the decision for seq %d exactly (%s); handed back to the scheduler",
            seq_id,
            why,
            extra={"seq_id": seq_id},
        )
        self.evict([seq_id])
        refused.append(seq_id)

    def _run(self, plan: dict[str, int]) -> StepOutput:
        """Step vLLM once on `plan` and check what it scheduled."""
        if not plan:
            return StepOutput((), (), ())
        self._scheduler.plan = plan
        started, cpu_started = time.perf_counter(), time.thread_time()
        try:
            outputs, _ = self._core.step()
        finally:
            self._scheduler.plan = {}
            self._count(plan, time.perf_counter() - started, time.thread_time() - cpu_started)
        scheduled = self._scheduler.last_output
        by_request = {h.request_id: h for h in self._held.values()}
        wrong: dict[str, str] = {}
        for request_id, tokens in plan.items():
            ran = scheduled.num_scheduled_tokens.get(request_id, 0)
            if ran != tokens:
                wrong[request_id] = f"vLLM scheduled {ran} tokens where {tokens} were decided"
        for request_id in scheduled.preempted_req_ids or ():
            wrong[request_id] = "vLLM preempted it on its own"
        tokens, finished, logprobs = [], [], []
        for core_outputs in outputs.values():
            for output in core_outputs.outputs:
                held = by_request.get(output.request_id)
                if held is None or output.request_id in wrong:
                    continue
                self._collect(held, output, tokens, finished, logprobs)
        refused: list[int] = []
        for request_id, why in wrong.items():
            held = by_request.get(request_id)
            if held is not None:
                self._refuse(held.seq_id, why, refused)
        if self._resume_points is not None:
            for held in self._held.values():
                self._resume_points.note(held.request, held.contract_hashes)
        return StepOutput(tuple(tokens), tuple(finished), tuple(refused), (), tuple(logprobs))

    def _count(self, plan: dict[str, int], seconds: float, cpu_seconds: float) -> None:
        stats = self.stats
        stats.num_steps += 1
        stats.step_seconds += seconds
        stats.step_cpu_seconds += cpu_seconds
        by_request = {h.request_id: h for h in self._held.values()}
        for request_id, tokens in plan.items():
            held = by_request.get(request_id)
            if held is not None and held.prefilled and tokens == 1:
                stats.num_decodes += 1
            else:
                stats.num_chunks += 1
                stats.num_prefill_tokens += tokens

    def _collect(self, held: _Held, output, tokens, finished, logprobs) -> None:
        new = tuple(output.new_token_ids)
        if new:
            tokens.append((held.seq_id, new))
            held.num_generated += len(new)
            if output.new_logprobs is not None:
                logprobs.append((held.seq_id, _token_logprobs(output.new_logprobs)))
        if output.finish_reason is None:
            return
        del self._held[held.seq_id]
        if self._resume_points is not None:
            self._resume_points.note(held.request, held.contract_hashes)
        finished.append(FinishedSequence(held.seq_id, _finish_reason(output), held.num_generated))


def _finish_reason(output) -> FinishReason:
    name = output.finish_reason.name
    if name == "LENGTH":
        return FinishReason.MAX_LENGTH
    if name == "STOP":
        return FinishReason.EOS if output.stop_reason is None else FinishReason.STOP
    return FinishReason.FAILED


def _token_logprobs(lists) -> tuple[TokenLogprobs, ...]:
    """vLLM's rows (the sampled token first, then the most likely ones) as the contract's."""
    out = []
    for ids, values in zip(lists.logprob_token_ids.tolist(), lists.logprobs.tolist()):
        out.append(TokenLogprobs(values[0], tuple(ids[1:]), tuple(values[1:])))
    return tuple(out)
