"""Small factories for driving the scheduling core from tests (no gRPC)."""
from __future__ import annotations

from service.core import (
    FinishedSequence, FinishReason, Scheduler, SchedulerConfig, SubmitParams, TokenUpdate,
    WorkerRegistration, WorkerReport,
)

# Free pages and slots that never limit admissions (the seed's 100, 100).
PLENTY = 100


class FakeClock:
    """A monotonic clock the test moves by hand (seconds)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance_ms(self, milliseconds: float) -> None:
        self.now += milliseconds / 1000.0


def make_config(**overrides) -> SchedulerConfig:
    """A config for the core's tests: the fifo policy (the contract's rules 2-7) unless
    the test names another."""
    overrides.setdefault("policy", "fifo")
    return SchedulerConfig(**overrides)


def make_scheduler(clock: FakeClock | None = None, **config_overrides) -> Scheduler:
    return Scheduler(make_config(**config_overrides), clock=clock or FakeClock())


def prompt(prompt_len: int, first_token: int = 1) -> tuple[int, ...]:
    return tuple(range(first_token, first_token + prompt_len))


def params(prompt_len: int = 8, max_new_tokens: int = 4, **overrides) -> SubmitParams:
    return SubmitParams(prompt_token_ids=prompt(prompt_len), max_new_tokens=max_new_tokens,
                        **overrides)


def submit(sched: Scheduler, prompt_len: int = 8, max_new_tokens: int = 4, **overrides) -> int:
    """Submit one sequence and return its seq_id."""
    return sched.submit(params(prompt_len, max_new_tokens, **overrides)).seq_id


def registration(worker_id: str = "w0", **overrides) -> WorkerRegistration:
    fields = dict(total_kv_pages=1000, page_size=16, total_gdn_slots=64)
    fields.update(overrides)
    return WorkerRegistration(worker_id=worker_id, **fields)


def register(sched: Scheduler, worker_id: str = "w0", **overrides):
    return sched.register_worker(registration(worker_id, **overrides))


def report(worker_id: str = "w0", *, waiting=(), running=(), kv_free_pages: int = PLENTY,
           gdn_free_slots: int = PLENTY, finished=(), preempted=(), draining: bool = False,
           tokens=(), incarnation: int = 0) -> WorkerReport:
    return WorkerReport(
        worker_id=worker_id, waiting=tuple(waiting), running=tuple(running),
        kv_free_pages=kv_free_pages, gdn_free_slots=gdn_free_slots,
        finished=tuple(finished), preempted=tuple(preempted), draining=draining,
        tokens=tuple(TokenUpdate(seq_id, tuple(ids)) for seq_id, ids in dict(tokens).items()),
        incarnation=incarnation,
    )


def finished(seq_id: int, reason: FinishReason = FinishReason.EOS,
             generated_tokens: int = 0) -> FinishedSequence:
    return FinishedSequence(seq_id, reason, generated_tokens)


def admit(sched: Scheduler, worker_id: str = "w0", **report_overrides) -> tuple[int, ...]:
    """One SelectBatch from a worker that holds nothing yet; returns the admitted ids."""
    decision = sched.select_batch(report(worker_id, **report_overrides))
    return tuple(chunk.seq_id for chunk in decision.prefill if chunk.spec is not None)


def prefill_ids(decision) -> list[int]:
    return [chunk.seq_id for chunk in decision.prefill]
