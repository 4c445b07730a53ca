"""All mapping between wire messages (lattice.scheduler.v1) and the core's domain types."""

from __future__ import annotations

from lattice.scheduler.v1 import scheduler_pb2 as pb
from service.core import (
    Decision,
    FinishedSequence,
    FinishReason,
    HandoffInstruction,
    HandoffResult,
    HandoffStatus,
    InvalidArgument,
    OutputView,
    PrefillChunk,
    SamplingParams,
    SchedulerStatus,
    SequenceInfo,
    SequenceSpec,
    SubmitParams,
    SubmitResult,
    TokenLogprobs,
    TokenRuns,
    TokenUpdate,
    WorkerRegistration,
    WorkerReport,
    WorkerRole,
    WorkerSettings,
)
from service.core.types import CacheReport

_FINISH_REASON_NUMBERS = {r.value for r in FinishReason}
_NO_CACHE = CacheReport()
_NO_TOKEN_RUNS = TokenRuns()

# Wire-level limits on what one message may carry, on top of the gRPC message size
# (--max-message-bytes) and the core's own limits (max_seq_len, max_queue). Each is far
# above any honest use; each keeps one call from filling memory or the logs. A request
# beyond one is INVALID_ARGUMENT, naming the field and the limit (docs/operations.md).
# request_id, tenant, adapter_id, worker_id and each of RegisterWorker.adapters, in UTF-8.
MAX_STRING_BYTES = 256
# SubmitRequest.stop_token_ids.
MAX_STOP_TOKEN_IDS = 1024
# RegisterWorkerRequest.adapters.
MAX_ADAPTERS = 1024
# One SelectBatch: seq ids in waiting, running, finished and preempted together.
MAX_REPORT_SEQ_IDS = 65536
# One SelectBatch: entries of tokens, and token ids over all of them.
MAX_REPORT_TOKENS = 65536
# SamplingParams.logprobs and prompt_logprobs (the contract's limit).
MAX_LOGPROBS = 20
# One SelectBatch: block hashes in cache.added and cache.removed together (a reset lists
# every resume point of the worker).
MAX_REPORT_CACHE_HASHES = 1 << 20
# FinishedSequence.error_message: kept up to this many characters (cut, not refused: a
# worker's long explanation must not cost it its report).
MAX_ERROR_MESSAGE_CHARS = 1000
# What error_message may not hold as is, escaped as \xNN / \uNNNN: control characters
# (NUL among them, which PostgreSQL text cannot hold) and line or paragraph separators.
_ESCAPED_IN_MESSAGES = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))} | {
    c: f"\\u{c:04x}" for c in (0x2028, 0x2029)
}


def _checked_string(field_name: str, value: str) -> str:
    """`value` if every store can hold it as is: within MAX_STRING_BYTES and without NUL.

    (It is valid UTF-8: a request whose strings are not does not parse, and is refused by
    service/server/interceptors/decode_errors.py, naming the field.) One rule for every
    store: SQLite would keep a NUL, PostgreSQL cannot, and a replica must not learn at its
    save that a value it already took cannot be kept.
    """
    num_bytes = len(value.encode())
    if num_bytes > MAX_STRING_BYTES:
        raise InvalidArgument(f"{field_name} is {num_bytes} bytes; the limit is {MAX_STRING_BYTES}")
    nul_at = value.find("\x00")
    if nul_at >= 0:
        raise InvalidArgument(
            f"{field_name} holds a NUL character (0x00) at index {nul_at}; "
            "ids and names must not contain NUL"
        )
    return value


def _check_count(what: str, count: int, noun: str, limit: int) -> None:
    if count > limit:
        raise InvalidArgument(f"{what} {count} {noun}; the limit is {limit}")


def worker_id(msg: pb.DeregisterWorkerRequest | pb.DrainWorkerRequest) -> str:
    """The worker_id of a request that only names a worker, within MAX_STRING_BYTES."""
    return _checked_string("worker_id", msg.worker_id)


def submit_params(msg: pb.SubmitRequest) -> SubmitParams:
    _check_count("stop_token_ids holds", len(msg.stop_token_ids), "ids", MAX_STOP_TOKEN_IDS)
    s = msg.sampling
    return SubmitParams(
        prompt_token_ids=tuple(msg.prompt_token_ids),
        max_new_tokens=msg.max_new_tokens,
        request_id=_checked_string("request_id", msg.request_id),
        adapter_id=_checked_string("adapter_id", msg.adapter_id),
        priority=msg.priority,
        tenant=_checked_string("tenant", msg.tenant),
        sampling=_sampling(s),
        stop_token_ids=tuple(msg.stop_token_ids),
    )


def _sampling(s: pb.SamplingParams) -> SamplingParams:
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(s, name) > MAX_LOGPROBS:
            raise InvalidArgument(f"sampling.{name} is {getattr(s, name)}; at most {MAX_LOGPROBS}")
    return SamplingParams(
        s.temperature,
        s.top_p,
        s.top_k,
        s.seed,
        logprobs=s.logprobs,
        prompt_logprobs=s.prompt_logprobs,
        ignore_eos=s.ignore_eos,
        min_new_tokens=s.min_new_tokens,
    )


def _logprobs_in(entries) -> tuple[TokenLogprobs, ...]:
    return tuple(
        TokenLogprobs(e.logprob, tuple(e.top_token_ids), tuple(e.top_logprobs)) for e in entries
    )


def _logprobs_out(entries) -> list[pb.TokenLogprobs]:
    return [
        pb.TokenLogprobs(
            logprob=e.logprob, top_token_ids=e.top_token_ids, top_logprobs=e.top_logprobs
        )
        for e in entries
    ]


def submit_response(result: SubmitResult) -> pb.SubmitResponse:
    return pb.SubmitResponse(seq_id=result.seq_id, queue_position=result.queue_position)


def sequence_info(info: SequenceInfo) -> pb.SequenceInfo:
    return pb.SequenceInfo(
        seq_id=info.seq_id,
        state=info.state.value,
        worker_id=info.worker_id,
        prompt_len=info.prompt_len,
        prefilled_tokens=info.prefilled_tokens,
        generated_tokens=info.generated_tokens,  # the core caps it at max_new_tokens
        finish_reason=info.finish_reason.value if info.finish_reason else 0,
        queue_position=info.queue_position,
        error_message=info.error_message,
        cached_tokens=info.cached_tokens,
    )


def worker_registration(msg: pb.RegisterWorkerRequest) -> WorkerRegistration:
    _check_count("adapters holds", len(msg.adapters), "names", MAX_ADAPTERS)
    return WorkerRegistration(
        worker_id=_checked_string("worker_id", msg.worker_id),
        total_kv_pages=msg.total_kv_pages,
        page_size=msg.page_size,
        total_gdn_slots=msg.total_gdn_slots,
        max_batch_size=msg.max_batch_size,
        adapters=tuple(_checked_string(f"adapters[{i}]", a) for i, a in enumerate(msg.adapters)),
        cache_block_tokens=_cache_block_tokens(msg),
        total_snapshot_slots=msg.total_snapshot_slots,
        max_step_tokens=msg.max_step_tokens,
        role=_role(msg.role),
        transfer_bytes_per_second=_transfer_rate(msg.transfer_bytes_per_second),
        handoff_address=_checked_string("handoff_address", msg.handoff_address),
        handoff_bytes_per_token=_not_negative(
            "handoff_bytes_per_token", msg.handoff_bytes_per_token
        ),
        handoff_fixed_bytes=_not_negative("handoff_fixed_bytes", msg.handoff_fixed_bytes),
    )


def _role(number: int) -> WorkerRole:
    """A registration's role; unset (0) is both, today's behaviour."""
    if number == 0:
        return WorkerRole.BOTH
    try:
        return WorkerRole(number)
    except ValueError:
        raise InvalidArgument(
            f"role must be WORKER_ROLE_BOTH, _PREFILL or _DECODE (1-3), got {number}"
        ) from None


def _transfer_rate(rate: float) -> float:
    return _not_negative("transfer_bytes_per_second", rate)


def _not_negative(name: str, value: float) -> float:
    """A finite number of 0 or above (0: unknown)."""
    if not 0 <= value < float("inf"):  # NaN fails too
        raise InvalidArgument(f"{name} must be 0 or above, got {value}")
    return value


def _cache_block_tokens(msg: pb.RegisterWorkerRequest) -> int:
    if msg.page_size and msg.cache_block_tokens % msg.page_size:
        raise InvalidArgument(
            f"cache_block_tokens must be a multiple of page_size "
            f"({msg.page_size}), got {msg.cache_block_tokens}"
        )
    return msg.cache_block_tokens


def worker_settings(settings: WorkerSettings) -> pb.RegisterWorkerResponse:
    return pb.RegisterWorkerResponse(
        chunk_size=settings.chunk_size,
        max_batch_size=settings.max_batch_size,
        prefill_reserve_pages=settings.prefill_reserve_pages,
        lease_ttl_ms=settings.lease_ttl_ms,
        incarnation=settings.incarnation,
        accepts_token_runs=True,
        accepts_running_unchanged=True,
        accepts_decide_later=True,
    )


def worker_report(
    msg: pb.SelectBatchRequest,
    running: tuple[int, ...] | None = None,
) -> WorkerReport:
    """The report; `running`: its running list when the message leaves it out
    (running_unchanged_since: service/server/running_lists.py)."""
    _check_report_size(msg, running)
    return WorkerReport(
        worker_id=_checked_string("worker_id", msg.worker_id),
        waiting=tuple(msg.waiting),
        running=tuple(msg.running) if running is None else running,
        kv_free_pages=msg.kv_free_pages,
        gdn_free_slots=msg.gdn_free_slots,
        finished=tuple(
            FinishedSequence(
                f.seq_id,
                _finish_reason(f.reason, i),
                f.generated_tokens,
                _error_message(f.error_message),
            )
            for i, f in enumerate(msg.finished)
        ),
        preempted=tuple(msg.preempted),
        draining=msg.draining,
        tokens=tuple(_token_update(t) for t in msg.tokens),
        # The packed form, copied in C: no object per sequence.
        token_runs=(
            TokenRuns(
                list(msg.token_seq_ids),
                list(msg.token_ids),
                list(msg.token_counts),
                list(msg.token_offsets),
            )
            if msg.token_seq_ids or msg.token_ids
            else _NO_TOKEN_RUNS
        ),
        incarnation=msg.incarnation,
        # As they are: the core checks their lengths against the worker's registration
        # before it reads them (a flood is refused without an object per hash).
        cache=(
            CacheReport(msg.cache.added, msg.cache.removed, msg.cache.reset)
            if msg.cache.added or msg.cache.removed or msg.cache.reset
            else _NO_CACHE
        ),
        kv_cached_pages=msg.kv_cached_pages,
        cache_misses=tuple(msg.cache_misses),
        last_step_us=msg.last_step_us,
        handoffs=tuple(_handoff_result(h, i) for i, h in enumerate(msg.handoffs)),
        applied_iteration=msg.applied_iteration,
        decide_later=msg.decide_later,
    )


def _handoff_result(h: pb.HandoffResult, index: int) -> HandoffResult:
    try:
        status = HandoffStatus(h.status)
    except ValueError:
        raise InvalidArgument(
            f"handoffs[{index}].status must be a HandoffStatus (1-6), got {h.status}"
        ) from None
    return HandoffResult(
        h.seq_id, h.transfer_id, status, h.num_bytes, h.transfer_us, _error_message(h.error_message)
    )


def _token_update(t: pb.TokenUpdate) -> TokenUpdate:
    offset = t.offset if t.HasField("offset") else None
    if not t.logprobs and not t.prompt_logprobs:  # the usual case, kept cheap
        return TokenUpdate(t.seq_id, tuple(t.token_ids), offset)
    return TokenUpdate(
        t.seq_id,
        tuple(t.token_ids),
        offset,
        _logprobs_in(t.logprobs),
        _logprobs_in(t.prompt_logprobs),
    )


def _check_report_size(msg: pb.SelectBatchRequest, running: tuple[int, ...] | None) -> None:
    num_running = len(msg.running) if running is None else len(running)
    num_seq_ids = len(msg.waiting) + num_running + len(msg.finished) + len(msg.preempted)
    _check_count(
        "waiting, running, finished and preempted hold",
        num_seq_ids,
        "seq ids in all",
        MAX_REPORT_SEQ_IDS,
    )
    _check_count("cache_misses holds", len(msg.cache_misses), "seq ids", MAX_REPORT_SEQ_IDS)
    _check_count(
        "cache.added and cache.removed hold",
        len(msg.cache.added) + len(msg.cache.removed),
        "block hashes in all",
        MAX_REPORT_CACHE_HASHES,
    )
    _check_count("tokens holds", len(msg.tokens), "updates", MAX_REPORT_TOKENS)
    _check_count(
        "tokens carry",
        sum(len(t.token_ids) for t in msg.tokens) if msg.tokens else 0,
        "token ids in all",
        MAX_REPORT_TOKENS,
    )
    # The packed form has the same limits of its own.
    _check_count("token_seq_ids holds", len(msg.token_seq_ids), "runs", MAX_REPORT_TOKENS)
    _check_count("token_ids holds", len(msg.token_ids), "token ids", MAX_REPORT_TOKENS)


def _error_message(text: str) -> str:
    """A worker's explanation as it is stored and shown: control characters escaped, then
    cut to MAX_ERROR_MESSAGE_CHARS, saying how long it was."""
    cleaned = text[:MAX_ERROR_MESSAGE_CHARS].translate(_ESCAPED_IN_MESSAGES)
    if len(text) <= MAX_ERROR_MESSAGE_CHARS and len(cleaned) <= MAX_ERROR_MESSAGE_CHARS:
        return cleaned
    return cleaned[: MAX_ERROR_MESSAGE_CHARS - 20] + f"... ({len(text)} chars)"


def _finish_reason(number: int, index: int) -> FinishReason:
    if number not in _FINISH_REASON_NUMBERS:
        raise InvalidArgument(
            f"finished[{index}].reason must be one of FINISH_REASON_EOS..FINISH_REASON_FAILED "
            f"(1-6), got {number}"
        )
    return FinishReason(number)


def decision(d: Decision, decode_all_running: bool = False) -> pb.SchedulerDecision:
    """The answer; `decode_all_running`: the decode list is the report's running list and
    the worker takes it so (decode then left empty)."""
    return pb.SchedulerDecision(
        prefill=[_prefill_chunk(c) for c in d.prefill] if d.prefill else None,
        decode=None if decode_all_running else d.decode,
        evict=d.evict,
        iteration=d.iteration,
        preempt=d.preempt,
        decode_all_running=decode_all_running,
        handoffs=[_handoff(h) for h in d.handoffs] if d.handoffs else None,
    )


def _handoff(h: HandoffInstruction) -> pb.Handoff:
    return pb.Handoff(
        seq_id=h.seq_id,
        direction=h.direction.value,
        transfer_id=h.transfer_id,
        peer_worker_id=h.peer_worker_id,
        peer_address=h.peer_address,
        num_tokens=h.num_tokens,
        num_generated=h.num_generated,
        spec=_spec(h.spec) if h.spec is not None else None,
        cached_tokens=h.cached_tokens,
        deadline_ms=h.deadline_ms,
    )


def running_needed() -> pb.SchedulerDecision:
    """The answer to a report naming a running list not held here: nothing applied."""
    return pb.SchedulerDecision(running_needed=True)


def _prefill_chunk(chunk: PrefillChunk) -> pb.PrefillChunk:
    msg = pb.PrefillChunk(
        seq_id=chunk.seq_id,
        chunk_start=chunk.chunk_start,
        chunk_len=chunk.chunk_len,
        cached_tokens=chunk.cached_tokens,
    )
    if chunk.spec is not None:
        msg.spec.CopyFrom(_spec(chunk.spec))
    return msg


def _spec(spec: SequenceSpec) -> pb.SequenceSpec:
    s = spec.sampling
    return pb.SequenceSpec(
        prompt_token_ids=spec.prompt_token_ids,
        max_new_tokens=spec.max_new_tokens,
        adapter_id=spec.adapter_id,
        sampling=pb.SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=s.seed,
            logprobs=s.logprobs,
            prompt_logprobs=s.prompt_logprobs,
            ignore_eos=s.ignore_eos,
            min_new_tokens=s.min_new_tokens,
        ),
        stop_token_ids=spec.stop_token_ids,
    )


def status(st: SchedulerStatus) -> pb.StatusResponse:
    return pb.StatusResponse(
        queue_depth=st.queue_depth,
        num_assigned=st.num_assigned,
        policy=st.policy,
        workers=[
            pb.WorkerStatus(
                worker_id=w.worker_id,
                num_assigned=w.num_assigned,
                kv_free_pages=w.kv_free_pages,
                gdn_free_slots=w.gdn_free_slots,
                total_kv_pages=w.total_kv_pages,
                total_gdn_slots=w.total_gdn_slots,
                iteration=w.iteration,
                draining=w.draining,
                seconds_since_last_call=w.seconds_since_last_call,
                incarnation=w.incarnation,
            )
            for w in st.workers
        ],
    )


def output_event(seq_id: int, view: OutputView) -> pb.GenerateEvent:
    """The event of an output view: the core's, or a replica's read of the database
    (`RemoteOutput`, of the same shape, whose logprobs are always empty: they are not
    persisted)."""
    return generate_event(
        seq_id,
        view.token_ids,
        view.finish_reason,
        view.finished,
        view.error_message,
        view.logprobs,
        view.prompt_logprobs,
    )


def generate_event(
    seq_id: int,
    token_ids=(),
    finish_reason: FinishReason | None = None,
    finished: bool = False,
    error_message: str = "",
    logprobs=(),
    prompt_logprobs=(),
) -> pb.GenerateEvent:
    return pb.GenerateEvent(
        seq_id=seq_id,
        token_ids=token_ids,
        finished=finished,
        finish_reason=finish_reason.value if finish_reason else 0,
        error_message=error_message,
        logprobs=_logprobs_out(logprobs) if logprobs else None,
        prompt_logprobs=_logprobs_out(prompt_logprobs) if prompt_logprobs else None,
    )
