"""Checks of clients' and workers' calls, before the core changes anything."""

from __future__ import annotations

from service.core.config import SchedulerConfig
from service.core.decide.batcher import DECISION_FIXED_BYTES
from service.core.errors import InvalidArgument, Superseded, UnknownWorker
from service.core.tables.ledger import WorkerRecord
from service.core.tables.sequences import spec_wire_bytes
from service.core.types import SubmitParams, TokenRuns, WorkerRegistration, WorkerReport


def check_submit(params: SubmitParams, config: SchedulerConfig, max_decision_bytes: int) -> None:
    """InvalidArgument if `params` could never run under `config`."""
    prompt_len = len(params.prompt_token_ids)
    if prompt_len == 0:
        raise InvalidArgument("prompt_token_ids must not be empty")
    if params.max_new_tokens == 0:
        raise InvalidArgument("max_new_tokens must be at least 1, got 0")
    limit = config.max_seq_len
    if prompt_len + params.max_new_tokens > limit:
        raise InvalidArgument(
            f"prompt_len + max_new_tokens = {prompt_len} + {params.max_new_tokens} = "
            f"{prompt_len + params.max_new_tokens} exceeds max_seq_len={limit}"
        )
    # Its spec, grown by every token it may generate, must fit in one decision.
    num_ids = prompt_len + params.max_new_tokens + len(params.stop_token_ids)
    if spec_wire_bytes(num_ids, params.adapter_id) > max_decision_bytes - DECISION_FIXED_BYTES:
        raise InvalidArgument(
            f"prompt_len + max_new_tokens + stop_token_ids = {num_ids} token ids may not "
            f"fit in one decision of at most {max_decision_bytes} bytes "
            "(--max-message-bytes); send a shorter prompt or raise the limit"
        )


def check_incarnation(worker: WorkerRecord, incarnation: int) -> None:
    """Refuse a call from an incarnation other than the registered one (0: the latest)."""
    if incarnation in (0, worker.incarnation):
        return
    if incarnation < worker.incarnation:
        raise Superseded(
            f"superseded: worker_id {worker.worker_id!r} incarnation {incarnation} was "
            f"replaced by incarnation {worker.incarnation} (a later RegisterWorker with the "
            "same worker_id: two processes share it); this call changed nothing"
        )
    raise UnknownWorker(
        f"worker_id {worker.worker_id!r} incarnation {incarnation} is unknown here (the "
        f"registered one is {worker.incarnation}; the scheduler's state is older than that "
        "registration): call RegisterWorker again"
    )


def validate_report(report: WorkerReport, worker: WorkerRecord) -> frozenset[int]:
    """Reject contradictory or oversized reports of `worker` before any state changes;
    returns the ids the report lists waiting or running."""
    max_batch_size = worker.settings.max_batch_size
    limit = 2 * max_batch_size
    for field_name, num in (
        ("waiting + running", len(report.waiting) + len(report.running)),
        ("finished", len(report.finished)),
        ("preempted", len(report.preempted)),
        ("tokens", len(report.tokens)),
        ("token_seq_ids", len(report.token_runs.seq_ids)),
    ):
        if num > limit:
            raise InvalidArgument(
                f"{field_name} holds {num} entries; a worker with max_batch_size "
                f"{max_batch_size} may report at most {limit}"
            )
    if report.token_runs.seq_ids or report.token_runs.token_ids:
        _check_token_runs(report.token_runs)
    if report.cache.added or report.cache.removed:
        check_cache_report(worker, report)
    seen = (
        frozenset(report.running)
        if not report.waiting
        else frozenset((*report.waiting, *report.running))
    )
    if len(seen) != len(report.waiting) + len(report.running):
        _refuse_repeated_id(report)
    for fin in report.finished:
        if fin.seq_id in seen:
            raise InvalidArgument(f"seq_id {fin.seq_id} is reported both finished and active")
    if report.preempted and not seen.isdisjoint(report.preempted):
        seq_id = next(s for s in report.preempted if s in seen)
        raise InvalidArgument(f"seq_id {seq_id} is reported both preempted and active")
    return seen


def max_resume_points(registration: WorkerRegistration) -> int:
    """The most resume points a worker can hold: the blocks its KV pages hold, and for
    a hybrid model (one with snapshot slots) at most one per snapshot slot."""
    if not registration.cache_block_tokens:
        return 0
    num_blocks = registration.total_kv_pages * registration.page_size
    num_blocks //= registration.cache_block_tokens
    if registration.total_snapshot_slots:
        return min(num_blocks, registration.total_snapshot_slots)
    return num_blocks


def check_cache_report(worker: WorkerRecord, report: WorkerReport) -> None:
    """InvalidArgument if `report`'s cache delta would leave `worker` more resume points
    than its registration can hold, or removes more than it could have held: what a worker
    says about its cache is bounded by what it registered (memory, and the report's work
    on the event loop). Checked before anything changes."""
    resume, cache = worker.resume_points, report.cache
    if not resume.block_tokens or not (cache.added or cache.removed):
        return  # no cache kept for it (the delta is ignored), or nothing to bound
    registration = worker.registration
    limit = max_resume_points(registration)
    for field_name, num in (
        ("cache.added", len(cache.added)),
        ("cache.removed", len(cache.removed)),
    ):
        if num > limit:
            _refuse_cache(registration, field_name, f"lists {num} block hashes", limit)
    num_after = resume.num_after(cache)
    if num_after > limit:
        _refuse_cache(registration, "cache.added", f"would leave {num_after} resume points", limit)


def _refuse_cache(registration: WorkerRegistration, field_name: str, what: str, limit: int):
    snapshots = (
        f" and {registration.total_snapshot_slots} snapshot slots"
        if registration.total_snapshot_slots
        else ""
    )
    raise InvalidArgument(
        f"{field_name} {what}; a worker registered with {registration.total_kv_pages} KV "
        f"pages of {registration.page_size} tokens{snapshots} holds at most {limit} resume "
        f"points (blocks of {registration.cache_block_tokens} tokens); nothing was applied"
    )


def _check_token_runs(runs: TokenRuns) -> None:
    """InvalidArgument if the packed arrays do not line up (docs/contract.md)."""
    num_runs = len(runs.seq_ids)
    if runs.counts and len(runs.counts) != num_runs:
        raise InvalidArgument(
            f"token_counts holds {len(runs.counts)} entries; token_seq_ids "
            f"holds {num_runs} (one count per run, or none)"
        )
    if runs.offsets and len(runs.offsets) != num_runs:
        raise InvalidArgument(
            f"token_offsets holds {len(runs.offsets)} entries; "
            f"token_seq_ids holds {num_runs} (one offset per run, or none)"
        )
    num_tokens = sum(runs.counts) if runs.counts else num_runs
    if num_tokens != len(runs.token_ids):
        raise InvalidArgument(
            f"token_ids holds {len(runs.token_ids)} tokens; the runs of "
            f"token_seq_ids and token_counts hold {num_tokens}"
        )


def _refuse_repeated_id(report: WorkerReport) -> None:
    """InvalidArgument naming the first id that waiting/running lists twice."""
    seen: set[int] = set()
    for field_name, ids in (("waiting", report.waiting), ("running", report.running)):
        for seq_id in ids:
            if seq_id in seen:
                raise InvalidArgument(
                    f"seq_id {seq_id} appears more than once in waiting/running "
                    f"(second time in {field_name})"
                )
            seen.add(seq_id)
