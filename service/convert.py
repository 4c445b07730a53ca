"""All mapping between wire messages (lattice.scheduler.v1) and the core's domain types."""
from __future__ import annotations

from lattice.scheduler.v1 import scheduler_pb2 as pb

from service.core import (
    Decision, FinishedSequence, FinishReason, InvalidArgument, PrefillChunk, SamplingParams,
    SchedulerStatus, SequenceInfo, SequenceSpec, SubmitParams, SubmitResult, TokenUpdate, WorkerRegistration,
    WorkerReport, WorkerSettings,
)

_FINISH_REASON_NUMBERS = {r.value for r in FinishReason}
_UINT32_MAX = 2**32 - 1


def submit_params(msg: pb.SubmitRequest) -> SubmitParams:
    s = msg.sampling
    return SubmitParams(
        prompt_token_ids=tuple(msg.prompt_token_ids),
        max_new_tokens=msg.max_new_tokens,
        request_id=msg.request_id,
        adapter_id=msg.adapter_id,
        priority=msg.priority,
        tenant=msg.tenant,
        sampling=SamplingParams(s.temperature, s.top_p, s.top_k, s.seed),
        stop_token_ids=tuple(msg.stop_token_ids),
    )


def submit_response(result: SubmitResult) -> pb.SubmitResponse:
    return pb.SubmitResponse(seq_id=result.seq_id, queue_position=result.queue_position)


def sequence_info(info: SequenceInfo) -> pb.SequenceInfo:
    return pb.SequenceInfo(
        seq_id=info.seq_id,
        state=info.state.value,
        worker_id=info.worker_id,
        prompt_len=info.prompt_len,
        prefilled_tokens=info.prefilled_tokens,
        # Saturated: a worker's finish report may count up to 2**32-1 tokens on top of
        # those kept from an earlier assignment.
        generated_tokens=min(info.generated_tokens, _UINT32_MAX),
        finish_reason=info.finish_reason.value if info.finish_reason else 0,
        queue_position=info.queue_position,
    )


def worker_registration(msg: pb.RegisterWorkerRequest) -> WorkerRegistration:
    return WorkerRegistration(
        worker_id=msg.worker_id,
        total_kv_pages=msg.total_kv_pages,
        page_size=msg.page_size,
        total_gdn_slots=msg.total_gdn_slots,
        max_batch_size=msg.max_batch_size,
        adapters=tuple(msg.adapters),
    )


def worker_settings(settings: WorkerSettings) -> pb.RegisterWorkerResponse:
    return pb.RegisterWorkerResponse(
        chunk_size=settings.chunk_size,
        max_batch_size=settings.max_batch_size,
        prefill_reserve_pages=settings.prefill_reserve_pages,
        lease_ttl_ms=settings.lease_ttl_ms,
    )


def worker_report(msg: pb.SelectBatchRequest) -> WorkerReport:
    return WorkerReport(
        worker_id=msg.worker_id,
        waiting=tuple(msg.waiting),
        running=tuple(msg.running),
        kv_free_pages=msg.kv_free_pages,
        gdn_free_slots=msg.gdn_free_slots,
        finished=tuple(
            FinishedSequence(f.seq_id, _finish_reason(f.reason, i), f.generated_tokens)
            for i, f in enumerate(msg.finished)
        ),
        preempted=tuple(msg.preempted),
        draining=msg.draining,
        tokens=tuple(
            TokenUpdate(t.seq_id, tuple(t.token_ids), t.offset if t.HasField("offset") else None)
            for t in msg.tokens
        ),
    )


def _finish_reason(number: int, index: int) -> FinishReason:
    if number not in _FINISH_REASON_NUMBERS:
        raise InvalidArgument(
            f"finished[{index}].reason must be one of FINISH_REASON_EOS..FINISH_REASON_FAILED "
            f"(1-6), got {number}"
        )
    return FinishReason(number)


def decision(d: Decision) -> pb.SchedulerDecision:
    return pb.SchedulerDecision(
        prefill=[_prefill_chunk(c) for c in d.prefill],
        decode=d.decode,
        evict=d.evict,
        iteration=d.iteration,
    )


def _prefill_chunk(chunk: PrefillChunk) -> pb.PrefillChunk:
    msg = pb.PrefillChunk(seq_id=chunk.seq_id, chunk_start=chunk.chunk_start,
                          chunk_len=chunk.chunk_len)
    if chunk.spec is not None:
        msg.spec.CopyFrom(_spec(chunk.spec))
    return msg


def _spec(spec: SequenceSpec) -> pb.SequenceSpec:
    s = spec.sampling
    return pb.SequenceSpec(
        prompt_token_ids=spec.prompt_token_ids,
        max_new_tokens=spec.max_new_tokens,
        adapter_id=spec.adapter_id,
        sampling=pb.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                   seed=s.seed),
        stop_token_ids=spec.stop_token_ids,
    )


def status(st: SchedulerStatus) -> pb.StatusResponse:
    return pb.StatusResponse(
        queue_depth=st.queue_depth,
        num_assigned=st.num_assigned,
        policy=st.policy,
        workers=[
            pb.WorkerStatus(
                worker_id=w.worker_id, num_assigned=w.num_assigned,
                kv_free_pages=w.kv_free_pages, gdn_free_slots=w.gdn_free_slots,
                total_kv_pages=w.total_kv_pages, total_gdn_slots=w.total_gdn_slots,
                iteration=w.iteration, draining=w.draining,
                seconds_since_last_call=w.seconds_since_last_call,
            )
            for w in st.workers
        ],
    )


def generate_event(seq_id: int, token_ids=(), finish_reason: FinishReason | None = None,
                   finished: bool = False) -> pb.GenerateEvent:
    return pb.GenerateEvent(
        seq_id=seq_id, token_ids=token_ids, finished=finished,
        finish_reason=finish_reason.value if finish_reason else 0,
    )
