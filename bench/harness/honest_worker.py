"""An in-process worker that holds what the scheduler gives it and reports exactly what it
has, counting KV pages and GDN slots as the reference engine does: for property tests of
the policies (tests/unit/test_policy_properties.py) and bench/policies.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from service.core import (
    FinishedSequence,
    FinishReason,
    SchedulerObserver,
    TokenUpdate,
    WorkerReport,
)


def pages_for(num_positions: int, page_size: int) -> int:
    return -(-num_positions // page_size)


@dataclass
class Held:
    spec_len: int
    max_new_tokens: int
    adapter_id: str
    num_prefilled: int = 0
    num_generated: int = 0

    def num_positions(self) -> int:
        return self.num_prefilled + max(0, self.num_generated - 1)


@dataclass
class HonestWorker:
    """Holds what it is given; counts pages and slots like the reference engine."""

    worker_id: str
    total_pages: int
    page_size: int
    total_slots: int
    prefill: dict[int, Held] = field(default_factory=dict)
    running: dict[int, Held] = field(default_factory=dict)
    done: list[FinishedSequence] = field(default_factory=list)
    tokens: dict[int, list[int]] = field(default_factory=dict)

    def held(self) -> list[Held]:
        return [*self.prefill.values(), *self.running.values()]

    def pages_used(self) -> int:
        return sum(pages_for(h.num_positions(), self.page_size) for h in self.held())

    def report(self):
        finished, self.done = self.done, []
        tokens, self.tokens = self.tokens, {}
        return WorkerReport(
            worker_id=self.worker_id,
            waiting=tuple(self.prefill),
            running=tuple(self.running),
            kv_free_pages=self.total_pages - self.pages_used(),
            gdn_free_slots=self.total_slots - len(self.held()),
            finished=tuple(finished),
            tokens=tuple(TokenUpdate(seq_id, tuple(ids)) for seq_id, ids in tokens.items()),
        )

    def execute(self, decision) -> None:
        for seq_id in (*decision.evict, *decision.preempt):
            self.prefill.pop(seq_id, None)
            self.running.pop(seq_id, None)
        for chunk in decision.prefill:
            if chunk.spec is not None:
                self.prefill[chunk.seq_id] = Held(
                    len(chunk.spec.prompt_token_ids),
                    chunk.spec.max_new_tokens,
                    chunk.spec.adapter_id,
                )
            held = self.prefill[chunk.seq_id]
            assert chunk.chunk_start == held.num_prefilled
            held.num_prefilled += chunk.chunk_len
            if self._cannot_fit(chunk.seq_id, held):
                continue
            if held.num_prefilled == held.spec_len:
                self.running[chunk.seq_id] = self.prefill.pop(chunk.seq_id)
                self._generate(chunk.seq_id)
        for seq_id in decision.decode:
            self._generate(seq_id)

    def _cannot_fit(self, seq_id: int, held: Held, num_more: int = 0) -> bool:
        """As the reference engine: a sequence that outgrows the whole pool (with
        `num_more` positions more) fails, counting the tokens it generated."""
        if pages_for(held.num_positions() + num_more, self.page_size) <= self.total_pages:
            return False
        self.prefill.pop(seq_id, None)
        self.running.pop(seq_id, None)
        self.done.append(FinishedSequence(seq_id, FinishReason.FAILED, held.num_generated))
        return True

    def _generate(self, seq_id: int) -> None:
        held = self.running[seq_id]
        if held.num_generated and self._cannot_fit(seq_id, held, num_more=1):
            return
        held.num_generated += 1
        self.tokens.setdefault(seq_id, []).append(7)
        if held.num_generated == held.max_new_tokens:
            del self.running[seq_id]
            self.done.append(FinishedSequence(seq_id, FinishReason.MAX_LENGTH, held.num_generated))


class Served(SchedulerObserver):
    """Tokens served per tenant, as the scheduler counts them."""

    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}

    def on_served(self, tenant, num_tokens) -> None:
        self.tokens[tenant] = self.tokens.get(tenant, 0) + num_tokens
