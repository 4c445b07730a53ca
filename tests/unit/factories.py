"""Small factories for driving the scheduling core from tests (no gRPC)."""

from __future__ import annotations

from service.core import (
    FinishedSequence,
    FinishReason,
    Scheduler,
    SchedulerConfig,
    SubmitParams,
    TokenUpdate,
    WorkerRegistration,
    WorkerReport,
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
    return SubmitParams(
        prompt_token_ids=prompt(prompt_len), max_new_tokens=max_new_tokens, **overrides
    )


def submit(sched: Scheduler, prompt_len: int = 8, max_new_tokens: int = 4, **overrides) -> int:
    """Submit one sequence and return its seq_id."""
    return sched.submit(params(prompt_len, max_new_tokens, **overrides)).seq_id


def registration(worker_id: str = "w0", **overrides) -> WorkerRegistration:
    fields = dict(total_kv_pages=1000, page_size=16, total_gdn_slots=64)
    fields.update(overrides)
    return WorkerRegistration(worker_id=worker_id, **fields)


def register(sched: Scheduler, worker_id: str = "w0", **overrides):
    return sched.register_worker(registration(worker_id, **overrides))


def report(
    worker_id: str = "w0",
    *,
    waiting=(),
    running=(),
    kv_free_pages: int = PLENTY,
    gdn_free_slots: int = PLENTY,
    finished=(),
    preempted=(),
    draining: bool = False,
    tokens=(),
    incarnation: int = 0,
    last_step_us: int = 0,
) -> WorkerReport:
    return WorkerReport(
        worker_id=worker_id,
        waiting=tuple(waiting),
        running=tuple(running),
        kv_free_pages=kv_free_pages,
        gdn_free_slots=gdn_free_slots,
        finished=tuple(finished),
        preempted=tuple(preempted),
        draining=draining,
        tokens=tuple(TokenUpdate(seq_id, tuple(ids)) for seq_id, ids in dict(tokens).items()),
        incarnation=incarnation,
        last_step_us=last_step_us,
    )


def finished(
    seq_id: int, reason: FinishReason = FinishReason.EOS, generated_tokens: int = 0
) -> FinishedSequence:
    return FinishedSequence(seq_id, reason, generated_tokens)


def admit(sched: Scheduler, worker_id: str = "w0", **report_overrides) -> tuple[int, ...]:
    """One SelectBatch from a worker that holds nothing yet; returns the admitted ids."""
    decision = sched.select_batch(report(worker_id, **report_overrides))
    return tuple(chunk.seq_id for chunk in decision.prefill if chunk.spec is not None)


def prefill_ids(decision) -> list[int]:
    return [chunk.seq_id for chunk in decision.prefill]


def write_version_1_state_dir(directory, queue_keys: dict[int, int], request_id: str = "") -> None:
    """A state dir as schema version 1 wrote it (no checksums, no submission times): one
    queued sequence per seq_id in `queue_keys` (with its queue key), prompt [5, 6]."""
    import json
    import sqlite3
    from pathlib import Path

    from service.state.rows import pack_token_ids

    db = sqlite3.connect(Path(directory) / "scheduler.db")
    db.executescript(f"""
        CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
        INSERT INTO meta VALUES ('schema_version', 1), ('next_seq_id', {max(queue_keys) + 1});
        CREATE TABLE sequences (seq_id INTEGER PRIMARY KEY, params TEXT NOT NULL,
            prompt BLOB NOT NULL, state INTEGER NOT NULL, worker_id TEXT, queue_key INTEGER,
            cursor INTEGER NOT NULL, prefilled_tokens INTEGER NOT NULL,
            num_generated INTEGER NOT NULL, num_generated_at_admission INTEGER NOT NULL,
            finish_reason INTEGER, finish_order INTEGER NOT NULL DEFAULT 0);
        CREATE TABLE workers (worker_id TEXT PRIMARY KEY, registration TEXT NOT NULL,
            drain_requested INTEGER NOT NULL DEFAULT 0);
    """)
    params = {
        "request_id": request_id,
        "max_new_tokens": 4,
        "adapter_id": "",
        "priority": 0,
        "tenant": "",
        "sampling": [0.0, 0.0, 0, 0],
        "stop_token_ids": [],
    }
    for seq_id, key in queue_keys.items():
        db.execute(
            "INSERT INTO sequences VALUES (?, ?, ?, 1, NULL, ?, 0, 0, 0, 0, NULL, 0)",
            (seq_id, json.dumps(params), pack_token_ids([5, 6]), key),
        )
    db.commit()
    db.close()
