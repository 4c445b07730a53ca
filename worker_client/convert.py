"""Mapping between wire messages and the engine's types (worker side)."""
from __future__ import annotations

from lattice.scheduler.v1 import scheduler_pb2 as pb

from worker_client.engine.api import ChunkWork, FinishReason, SequenceSpec, StepOutput

_FINISH_REASON = {
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.MAX_LENGTH: pb.FINISH_REASON_MAX_LENGTH,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.FAILED: pb.FINISH_REASON_FAILED,
}


def chunk_work(chunk: pb.PrefillChunk) -> ChunkWork:
    spec = None
    if chunk.HasField("spec"):
        s = chunk.spec
        spec = SequenceSpec(
            prompt_token_ids=tuple(s.prompt_token_ids), max_new_tokens=s.max_new_tokens,
            temperature=s.sampling.temperature, top_p=s.sampling.top_p,
            top_k=s.sampling.top_k, seed=s.sampling.seed,
            stop_token_ids=tuple(s.stop_token_ids), adapter_id=s.adapter_id,
        )
    return ChunkWork(chunk.seq_id, chunk.chunk_start, chunk.chunk_len, spec)


class PendingReport:
    """What the engine produced since the last successful SelectBatch, to report next."""

    def __init__(self) -> None:
        self.finished: list[pb.FinishedSequence] = []
        self.preempted: list[int] = []
        self.tokens: dict[int, list[int]] = {}

    def __bool__(self) -> bool:
        return bool(self.finished or self.preempted or self.tokens)

    def add(self, out: StepOutput) -> None:
        for seq_id, token_ids in out.tokens:
            self.tokens.setdefault(seq_id, []).extend(token_ids)
        for fin in out.finished:
            self.finished.append(pb.FinishedSequence(
                seq_id=fin.seq_id, reason=_FINISH_REASON[fin.reason],
                generated_tokens=fin.generated_tokens))
        self.preempted.extend(out.preempted)

    def clear(self) -> None:
        self.finished.clear()
        self.preempted.clear()
        self.tokens.clear()

    def request(self, worker_id: str, *, waiting, running, kv_free_pages: int,
                gdn_free_slots: int, draining: bool) -> pb.SelectBatchRequest:
        return pb.SelectBatchRequest(
            worker_id=worker_id, waiting=waiting, running=running,
            kv_free_pages=kv_free_pages, gdn_free_slots=gdn_free_slots,
            finished=self.finished, preempted=self.preempted, draining=draining,
            tokens=[pb.TokenUpdate(seq_id=s, token_ids=t) for s, t in self.tokens.items()],
        )
