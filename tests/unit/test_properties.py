"""Random interleavings of clients and honest simulated workers against the core.

A reference model tracks, independently of the core, which worker each sequence was
handed to and what each worker was told; after every step the core must agree with
it, and every decision must satisfy the contract's rules 3-7 (fifo), or the budget
policies' rules: the token budget is never exceeded, every running sequence decodes
unless preempted, admissions' pages fit (the simulated workers count their pages and
slots honestly and never run out), the LoRA limit holds.

The core saves to a MemoryStore; a rule replaces it by a new core loaded from that
store (a restart), which must look exactly as the old one did, and the simulated
workers carry on against it.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from service.core import (
    FinishedSequence,
    FinishReason,
    QueueFull,
    Scheduler,
    SequenceState,
    UnknownWorker,
)
from service.core.persist.store import MemoryStore
from service.state.sqlite import SqliteStateStore

from .factories import FakeClock, make_config, params, registration, report

CONFIG = dict(
    max_batch_size=3,
    chunk_size=4,
    prefill_reserve_pages=2,
    max_seq_len=32,
    max_queue=6,
    lease_ttl_ms=1000,
)
# The budget policies: a budget that binds, small pages, at most one adapter per worker.
BUDGET_CONFIG = dict(
    CONFIG, max_num_batched_tokens=8, min_prefill_chunk=2, kv_watermark_pages=1, max_loras=1
)
WORKERS = {
    "w0": dict(adapters=()),
    "w1": dict(adapters=("a",), max_batch_size=2),
    "w2": dict(adapters=("a", "b")),
}
# What the simulated workers of the budget policies have, counted honestly.
PAGE_SIZE, TOTAL_PAGES, TOTAL_SLOTS = 4, 8, 3
ASSIGNED = (SequenceState.PREFILLING, SequenceState.DECODING)


def pages_for(num_positions: int) -> int:
    return -(-num_positions // PAGE_SIZE)


def token(seq_id: int, index: int) -> int:
    """The token a simulated worker generates at output position `index`: resuming
    from a wrong position shows up as a gap or a repeat in the output."""
    return seq_id * 1000 + index


@dataclass
class Held:
    """One sequence on a simulated worker."""

    spec_len: int
    max_new_tokens: int
    first_index: int  # output position of this assignment's first token
    adapter_id: str = ""
    num_prefilled: int = 0
    num_generated: int = 0

    @property
    def num_positions(self) -> int:
        """KV positions written: the prompt as prefilled, then one per decode (the KV of
        the token sampled before it), as the reference engine counts them."""
        return self.num_prefilled + max(0, self.num_generated - 1)


@dataclass
class SimWorker:
    """A worker that holds exactly what it was given and reports honestly."""

    worker_id: str
    registered: bool = False
    prefill: dict[int, Held] = field(default_factory=dict)
    running: dict[int, Held] = field(default_factory=dict)
    done: list[FinishedSequence] = field(default_factory=list)
    tokens: dict[int, list[int]] = field(default_factory=dict)

    def restart(self) -> None:
        self.prefill.clear()
        self.running.clear()
        self.done.clear()
        self.tokens.clear()

    def held(self) -> list[Held]:
        return [*self.prefill.values(), *self.running.values()]

    def pages_used(self) -> int:
        return sum(pages_for(h.num_positions) for h in self.held())

    def generate(self, seq_id: int) -> None:
        held = self.running[seq_id]
        self.tokens.setdefault(seq_id, []).append(
            token(seq_id, held.first_index + held.num_generated)
        )
        held.num_generated += 1
        if held.num_generated == held.max_new_tokens:
            del self.running[seq_id]
            self.done.append(FinishedSequence(seq_id, FinishReason.MAX_LENGTH, held.num_generated))


class SchedulerMachine(RuleBasedStateMachine):
    store_kind = "memory"
    policy = "fifo"

    @property
    def config(self) -> dict:
        return CONFIG if self.policy == "fifo" else BUDGET_CONFIG

    @property
    def counts_pages(self) -> bool:
        """The workers report what they really have free (the budget policies plan with it)."""
        return self.policy != "fifo"

    @initialize()
    def start(self):
        self.clock = FakeClock()
        self.state_dir = tempfile.mkdtemp(prefix="lattice-sm-")
        self.store = self.open_store()
        self.sched = self.new_core()
        self.sims = {w: SimWorker(w) for w in WORKERS}
        # The reference model.
        self.prompt_len: dict[int, int] = {}
        self.max_new_tokens: dict[int, int] = {}
        self.adapter: dict[int, str] = {}
        self.owner: dict[int, str | None] = {}
        self.finished: dict[int, FinishReason] = {}
        self.output: dict[int, list[int]] = {}
        self.cursor: dict[int, int] = {}
        self.spec_len: dict[int, int] = {}
        self.ever_admitted: set[int] = set()
        self.request_ids: dict[str, int] = {}
        self.last_call: dict[str, float] = {}  # registered workers, as the core sees them
        self.iteration: dict[str, int] = {}
        for worker_id in WORKERS:
            self.register(worker_id)

    def open_store(self):
        if self.store_kind == "memory":
            return MemoryStore()
        return SqliteStateStore(self.state_dir, fsync="never")

    def teardown(self):
        if hasattr(self, "store"):
            self.store.close()
        if hasattr(self, "state_dir"):
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def new_core(self) -> Scheduler:
        return Scheduler(
            make_config(policy=self.policy, **self.config),
            clock=self.clock,
            wall_clock=self.clock,
            store=self.store,
        )

    def observable_state(self):
        status = self.sched.status()
        return (
            [self.sched.get_sequence(s) for s in sorted(self.prompt_len)],
            [self.sched.read_output(s, 0) for s in sorted(self.prompt_len)],
            status.queue_depth,
            status.num_assigned,
            # (draining is as of the last report; the next report says it again)
            sorted((w.worker_id, w.num_assigned) for w in status.workers),
        )

    # ------------------------------------------------------------ model helpers

    def model_register(self, worker_id: str) -> None:
        self.model_drop(worker_id)
        self.last_call[worker_id] = self.clock()
        self.iteration[worker_id] = 0

    def model_drop(self, worker_id: str) -> None:
        self.last_call.pop(worker_id, None)
        for seq_id, owner in self.owner.items():
            if owner == worker_id:
                self.owner[seq_id] = None

    def model_expire(self) -> list[str]:
        now = self.clock()
        expired = [
            w
            for w, last in self.last_call.items()
            if (now - last) * 1000.0 > CONFIG["lease_ttl_ms"]
        ]
        for worker_id in expired:
            self.model_drop(worker_id)
        return expired

    def can_run(self, worker_id: str, seq_id: int) -> bool:
        return not self.adapter[seq_id] or self.adapter[seq_id] in WORKERS[worker_id]["adapters"]

    # ------------------------------------------------------------ client rules

    @rule(
        prompt_len=st.integers(1, 12),
        max_new_tokens=st.integers(1, 10),
        adapter_id=st.sampled_from(["", "", "", "a", "b"]),
        request=st.sampled_from(["none", "new", "repeat"]),
        priority=st.sampled_from([0, 0, -1, 2]),
        tenant=st.sampled_from(["", "t1", "t2"]),
    )
    def submit(self, prompt_len, max_new_tokens, adapter_id, request, priority, tenant):
        depth = self.sched.status().queue_depth
        if request == "repeat" and self.request_ids:
            request_id = sorted(self.request_ids)[0]
            result = self.sched.submit(params(prompt_len, max_new_tokens, request_id=request_id))
            assert result.seq_id == self.request_ids[request_id]
            assert self.sched.status().queue_depth == depth
            return
        request_id = f"req-{len(self.prompt_len)}" if request == "new" else ""
        submitted = params(
            prompt_len,
            max_new_tokens,
            adapter_id=adapter_id,
            request_id=request_id,
            priority=priority,
            tenant=tenant,
        )
        if depth >= CONFIG["max_queue"]:
            with pytest.raises(QueueFull):
                self.sched.submit(submitted)
            return
        result = self.sched.submit(submitted)
        seq_id = result.seq_id
        assert seq_id not in self.prompt_len
        if self.policy == "fair":  # its place depends on band, tenant and arrival
            assert 0 <= result.queue_position <= depth
        else:
            assert result.queue_position == depth
        self.prompt_len[seq_id] = prompt_len
        self.max_new_tokens[seq_id] = max_new_tokens
        self.adapter[seq_id] = adapter_id
        self.owner[seq_id] = None
        self.output[seq_id] = []
        if request_id:
            self.request_ids[request_id] = seq_id

    @rule(pick=st.integers(0, 10_000))
    def cancel(self, pick):
        if not self.prompt_len:
            return
        seq_id = sorted(self.prompt_len)[pick % len(self.prompt_len)]
        assert self.sched.cancel(seq_id) is (seq_id not in self.finished)
        if seq_id not in self.finished:
            self.finished[seq_id] = FinishReason.CANCELLED
            self.owner[seq_id] = None

    # ------------------------------------------------------------ worker rules

    @rule(worker_id=st.sampled_from(sorted(WORKERS)))
    def register(self, worker_id):
        sim = self.sims[worker_id]
        sim.restart()
        sim.registered = True
        resources = dict(WORKERS[worker_id])
        if self.counts_pages:
            resources.update(
                total_kv_pages=TOTAL_PAGES, page_size=PAGE_SIZE, total_gdn_slots=TOTAL_SLOTS
            )
        settings_ = self.sched.register_worker(registration(worker_id, **resources))
        assert settings_.max_batch_size == WORKERS[worker_id].get(
            "max_batch_size", CONFIG["max_batch_size"]
        )
        self.model_register(worker_id)

    @rule(worker_id=st.sampled_from(sorted(WORKERS)))
    def deregister(self, worker_id):
        sim = self.sims[worker_id]
        sim.restart()
        sim.registered = False
        if worker_id not in self.last_call:
            with pytest.raises(UnknownWorker):
                self.sched.deregister_worker(worker_id)
            return
        num_held = sum(1 for owner in self.owner.values() if owner == worker_id)
        assert self.sched.deregister_worker(worker_id) == num_held
        self.model_drop(worker_id)

    @rule()
    def restart_scheduler(self):
        before = self.observable_state()
        if self.store_kind == "sqlite":  # a new process opens the file afresh
            self.store.close()
            self.store = self.open_store()
        self.sched = self.new_core()
        assert self.observable_state() == before
        # Recovered workers start a fresh lease and count iterations from 0 again.
        for worker_id in self.last_call:
            self.last_call[worker_id] = self.clock()
            self.iteration[worker_id] = 0
        # New ids continue after every id used before.
        next_id = max(self.prompt_len, default=0) + 1
        assert self.sched._sequences.next_seq_id >= next_id

    @rule(milliseconds=st.sampled_from([100, 100, 400, 1200]))
    def advance_clock(self, milliseconds):
        self.clock.advance_ms(milliseconds)

    @rule()
    def expire_leases(self):
        assert sorted(self.sched.expire_leases()) == sorted(self.model_expire())

    @rule(worker_id=st.sampled_from(sorted(WORKERS)), rnd=st.randoms(use_true_random=False))
    def one_worker_steps(self, worker_id, rnd):
        self.select_batch(worker_id, rnd)

    def select_batch(self, worker_id, rnd):
        sim = self.sims[worker_id]
        if not sim.registered:
            return self.register(worker_id)
        worker_report = self.build_report(sim, rnd)
        self.model_expire()
        if worker_id not in self.last_call:
            with pytest.raises(UnknownWorker):
                self.sched.select_batch(worker_report)
            sim.restart()
            sim.registered = False  # it must register again
            return
        owner_before = dict(self.owner)
        decision = self.sched.select_batch(worker_report)
        self.last_call[worker_id] = self.clock()
        self.iteration[worker_id] += 1
        assert decision.iteration == self.iteration[worker_id]
        self.apply_report_to_model(worker_report, owner_before)
        self.check_decision(worker_report, decision, owner_before)
        self.execute(sim, decision)

    @rule(rnd=st.randoms(use_true_random=False))
    def every_worker_steps(self, rnd):
        for worker_id in WORKERS:
            self.select_batch(worker_id, rnd)

    def build_report(self, sim: SimWorker, rnd: random.Random):
        preempted, finished = [], list(sim.done)
        sim.done.clear()
        for table in (sim.prefill, sim.running):
            for seq_id in list(table):
                roll = rnd.random()
                if roll < 0.05:  # preempted, reported one way or the other
                    del table[seq_id]
                    if rnd.random() < 0.5:
                        preempted.append(seq_id)
                    else:
                        finished.append(FinishedSequence(seq_id, FinishReason.PREEMPTED))
                elif roll < 0.07:  # lost: never mentioned again
                    del table[seq_id]
                    sim.tokens.pop(seq_id, None)
                elif roll < 0.15 and table is sim.running:
                    held = table.pop(seq_id)
                    finished.append(FinishedSequence(seq_id, FinishReason.EOS, held.num_generated))
        tokens = dict(sim.tokens)
        sim.tokens.clear()
        if self.counts_pages:
            kv_free_pages = TOTAL_PAGES - sim.pages_used()
            gdn_free_slots = TOTAL_SLOTS - len(sim.held())
        else:
            kv_free_pages, gdn_free_slots = rnd.randint(0, 4), rnd.randint(0, 4)
        return report(
            sim.worker_id,
            waiting=list(sim.prefill),
            running=list(sim.running),
            kv_free_pages=kv_free_pages,
            gdn_free_slots=gdn_free_slots,
            finished=finished,
            preempted=preempted,
            draining=rnd.random() < 0.15,
            tokens=tokens,
        )

    def apply_report_to_model(self, worker_report, owner_before):
        worker_id = worker_report.worker_id
        for update in worker_report.tokens:
            if owner_before.get(update.seq_id) == worker_id:
                self.output[update.seq_id].extend(update.token_ids)
        for fin in worker_report.finished:
            if self.owner.get(fin.seq_id) == worker_id:
                self.owner[fin.seq_id] = None
                if fin.reason is not FinishReason.PREEMPTED:
                    self.finished[fin.seq_id] = fin.reason
        for seq_id in worker_report.preempted:
            if self.owner.get(seq_id) == worker_id:
                self.owner[seq_id] = None
        reported = set(worker_report.waiting) | set(worker_report.running)
        for seq_id, owner in self.owner.items():
            if owner == worker_id and seq_id not in reported:
                self.owner[seq_id] = None  # lost

    def check_decision(self, worker_report, decision, owner_before):
        worker_id = worker_report.worker_id
        waiting, running = worker_report.waiting, worker_report.running
        reported = [*waiting, *running]
        owned = {s for s in reported if owner_before.get(s) == worker_id}
        new = [c for c in decision.prefill if c.spec is not None]
        continuations = [c for c in decision.prefill if c.spec is None]
        prefill_ids = [c.seq_id for c in decision.prefill]
        # Rules 4-7; every running sequence decodes unless the scheduler preempts it.
        assert set(decision.preempt) <= owned
        assert decision.decode == tuple(
            s for s in running if s in owned and s not in decision.preempt
        )
        assert decision.evict == tuple(s for s in reported if owner_before.get(s) != worker_id)
        assert decision.prefill == (*new, *continuations)
        assert len(prefill_ids) == len(set(prefill_ids))
        assert not set(prefill_ids) & (set(decision.decode) | set(decision.preempt))
        assert not set(decision.evict) & (set(prefill_ids) | set(decision.decode))
        # An honest worker is only ever told to evict what a client cancelled.
        assert all(self.finished.get(s) is FinishReason.CANCELLED for s in decision.evict)
        for seq_id in (*prefill_ids, *decision.decode):
            assert seq_id not in self.finished
        for seq_id in decision.preempt:
            self.owner[seq_id] = None
        event("a decision preempts" if decision.preempt else "no preemption")
        event(
            "a decision admits"
            if any(c.spec is not None for c in decision.prefill)
            else "no admission"
        )
        # Rule 5: continuations pick up at the cursor.
        for chunk in continuations:
            assert chunk.seq_id in owned and chunk.seq_id in waiting
            assert chunk.chunk_start == self.cursor[chunk.seq_id]
            assert 1 <= chunk.chunk_len <= self.spec_len[chunk.seq_id] - chunk.chunk_start
        if self.policy == "fifo":
            self.check_fifo_lengths(worker_report, new, continuations, owned)
        else:
            self.check_budget(decision, new, continuations)
        for chunk in continuations:
            self.cursor[chunk.seq_id] += chunk.chunk_len
        for chunk in new:
            seq_id = chunk.seq_id
            assert self.owner[seq_id] is None and seq_id not in self.finished
            assert seq_id not in reported and self.can_run(worker_id, seq_id)
            prompt = params(self.prompt_len[seq_id]).prompt_token_ids
            assert chunk.spec.prompt_token_ids == prompt + tuple(self.output[seq_id])
            assert chunk.spec.max_new_tokens == (
                self.max_new_tokens[seq_id] - len(self.output[seq_id])
            )
            assert chunk.spec.max_new_tokens >= 1
            self.owner[seq_id] = worker_id
            self.spec_len[seq_id] = len(chunk.spec.prompt_token_ids)
            self.cursor[seq_id] = chunk.chunk_len
            self.ever_admitted.add(seq_id)

    def check_fifo_lengths(self, worker_report, new, continuations, owned):
        """fifo: every prefill in progress gets a chunk of chunk_size; admissions take the
        whole admission budget while anything fits (rule 3)."""
        worker_id = worker_report.worker_id
        reported = [*worker_report.waiting, *worker_report.running]
        assert [c.seq_id for c in continuations] == [s for s in worker_report.waiting if s in owned]
        for chunk in continuations:
            assert chunk.chunk_len == min(
                CONFIG["chunk_size"], self.spec_len[chunk.seq_id] - chunk.chunk_start
            )
        for chunk in new:
            spec_len = len(chunk.spec.prompt_token_ids)
            assert (chunk.chunk_start, chunk.chunk_len) == (0, min(CONFIG["chunk_size"], spec_len))
        max_batch_size = WORKERS[worker_id].get("max_batch_size", CONFIG["max_batch_size"])
        num_active = len(reported)
        budget = min(max(0, max_batch_size - num_active), worker_report.gdn_free_slots)
        if worker_report.draining or (
            worker_report.kv_free_pages < CONFIG["prefill_reserve_pages"] and num_active
        ):
            budget = 0
        assert len(new) <= budget
        if len(new) < budget:
            left = [
                s
                for s in self.prompt_len
                if self.owner[s] is None
                and s not in self.finished
                and s not in reported
                and self.can_run(worker_id, s)
                and s not in [c.seq_id for c in new]
            ]
            assert left == [], f"{left} could have been admitted to {worker_id}"

    def check_budget(self, decision, new, continuations):
        """budget, fair: the token budget holds; a first chunk takes what is left of it
        (at most the prompt) and at least min(C, prompt)."""
        token_budget = BUDGET_CONFIG["max_num_batched_tokens"]
        used = len(decision.decode) + sum(c.chunk_len for c in continuations)
        for chunk in new:
            spec_len = len(chunk.spec.prompt_token_ids)
            assert chunk.chunk_start == 0
            assert chunk.chunk_len == min(spec_len, token_budget - used)
            assert chunk.chunk_len >= min(BUDGET_CONFIG["min_prefill_chunk"], spec_len)
            used += chunk.chunk_len
        assert used <= token_budget

    def execute(self, sim: SimWorker, decision) -> None:
        for seq_id in (*decision.evict, *decision.preempt):
            sim.prefill.pop(seq_id, None)
            sim.running.pop(seq_id, None)
            sim.tokens.pop(seq_id, None)
        for chunk in decision.prefill:
            if chunk.spec is not None:
                spec = chunk.spec
                sim.prefill[chunk.seq_id] = Held(
                    spec_len=len(spec.prompt_token_ids),
                    max_new_tokens=spec.max_new_tokens,
                    first_index=len(spec.prompt_token_ids) - self.prompt_len[chunk.seq_id],
                    adapter_id=spec.adapter_id,
                )
            held = sim.prefill[chunk.seq_id]
            assert chunk.chunk_start == held.num_prefilled
            held.num_prefilled += chunk.chunk_len
            if held.num_prefilled == held.spec_len:
                sim.running[chunk.seq_id] = sim.prefill.pop(chunk.seq_id)
                sim.generate(chunk.seq_id)  # the first token comes with the last chunk
        for seq_id in decision.decode:
            sim.generate(seq_id)
        if self.counts_pages:
            # What the scheduler planned fits in what the worker has.
            assert sim.pages_used() <= TOTAL_PAGES
            assert len(sim.held()) <= TOTAL_SLOTS
            worker_batch = WORKERS[sim.worker_id].get("max_batch_size", CONFIG["max_batch_size"])
            assert len(sim.held()) <= worker_batch
            assert (
                len({h.adapter_id for h in sim.held() if h.adapter_id})
                <= (BUDGET_CONFIG["max_loras"])
            )

    # ------------------------------------------------------------ invariants

    @invariant()
    def every_sequence_is_queued_assigned_or_finished(self):
        if not hasattr(self, "sched"):
            return
        infos = [self.sched.get_sequence(s) for s in self.prompt_len]
        for info in infos:
            seq_id = info.seq_id
            if seq_id in self.finished:
                assert info.state is SequenceState.FINISHED
                assert info.finish_reason is self.finished[seq_id]
            elif self.owner[seq_id] is not None:
                assert info.state in ASSIGNED and info.worker_id == self.owner[seq_id]
            else:
                assert info.state is SequenceState.QUEUED and info.worker_id == ""
            assert self.sched.read_output(seq_id, 0).token_ids == tuple(self.output[seq_id])
            expected = [token(seq_id, index) for index in range(len(self.output[seq_id]))]
            assert self.output[seq_id] == expected  # no gap, no repeat across resumptions
            assert info.generated_tokens >= len(self.output[seq_id])
        status = self.sched.status()
        queued = [i for i in infos if i.state is SequenceState.QUEUED]
        assigned = [i for i in infos if i.state in ASSIGNED]
        assert status.queue_depth == len(queued)
        assert sorted(i.queue_position for i in queued) == list(range(len(queued)))
        # A sequence on two workers would be counted twice here.
        assert status.num_assigned == len(assigned)
        per_worker = {w.worker_id: w.num_assigned for w in status.workers}
        assert set(per_worker) == set(self.last_call)
        for worker_id, num_assigned in per_worker.items():
            assert num_assigned == sum(1 for i in assigned if i.worker_id == worker_id)
        # Only requeues, never submissions, take the queue past max_queue.
        never_admitted = [i for i in queued if i.seq_id not in self.ever_admitted]
        assert len(never_admitted) <= CONFIG["max_queue"]


SchedulerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_scheduler_state_machine = SchedulerMachine.TestCase


class SqliteSchedulerMachine(SchedulerMachine):
    """The same, saving to SQLite: the token log and its clean-up replay exactly."""

    store_kind = "sqlite"


SqliteSchedulerMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_scheduler_state_machine_on_sqlite = SqliteSchedulerMachine.TestCase


class BudgetSchedulerMachine(SchedulerMachine):
    """The budget policy, with workers that count their pages and slots."""

    policy = "budget"


BudgetSchedulerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_budget_state_machine = BudgetSchedulerMachine.TestCase


class FairSchedulerMachine(SchedulerMachine):
    """The fair policy; its restarts keep the order (arrival, bands, tenant counters)."""

    policy = "fair"


FairSchedulerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_fair_state_machine = FairSchedulerMachine.TestCase


class SqliteFairSchedulerMachine(FairSchedulerMachine):
    """The fair order saved to SQLite and read back."""

    store_kind = "sqlite"


SqliteFairSchedulerMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_fair_state_machine_on_sqlite = SqliteFairSchedulerMachine.TestCase
