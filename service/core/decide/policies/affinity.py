"""The price of running one sequence at a place: what placement weighs a cached prefix
against (docs/policies.md, "Placement").

A place is a worker as seen by one decision: how much of the sequence's prompt it has
cached, how many sequences it holds, and how long until it would take the sequence. Its
cost, in sequence-seconds, is the wait plus the sequence's prefill (the tokens it does
not have cached, at the learned step cost), paid once by the sequence itself and once
by every sequence already there, whose next steps carry that prefill beside their
decodes (their TPOT). A prefix hit saves prefill; holding a sequence for its holder, or
piling work onto one worker while another is idle, costs waiting and TPOT. Affinity
pays only when the first outweighs the second:

    cost(place) = wait + prefill(uncached tokens) x (1 + load)

Two places whose costs differ by less than one decode step (of the busier one), or than
the time either takes to call again, are a tie, which goes to the longer cached prefix.

So at light load an idle worker (load 0, no wait) takes a sequence unless its holder
saves most of the prompt (a conversation's next turn), and under load, where every
place carries the prefill for many, the hit wins. Pure and small: placement in the
pull design calls it per candidate, and anything that chooses among workers for a
queued sequence (a replica's claim) can call the same `prefers`.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.core.learn.step_model import StepShape, StepTimeModel

# The most a place's gap between calls widens a near tie, in decode steps of the busier
# place.
MAX_GAP_STEPS = 4


@dataclass(frozen=True, slots=True)
class Place:
    """A worker as a place to run one sequence."""

    # Prompt tokens of the sequence cached there (its longest resume point).
    cached_tokens: int
    # Sequences assigned there, which each carry the prefill's time in their steps.
    load: int
    # Until it would take the sequence: 0 for the worker asking now.
    wait_seconds: float = 0.0
    # Its mean time between calls while busy (0: not measured): a place takes a sequence
    # only when it calls, so its wait is known to within this.
    call_gap_seconds: float = 0.0


class AffinityPrice:
    """Prices places on one worker's step model (the asker's, learned or cautious)."""

    def __init__(self, model: StepTimeModel) -> None:
        self._model = model

    def prefill_seconds(self, num_tokens: int, cached_tokens: int) -> float:
        """What prefilling a `num_tokens` prompt from `cached_tokens` adds to the steps
        that carry it (`StepTimeModel.prefill_seconds`: never more from a longer cached
        prefix)."""
        return self._model.prefill_seconds(num_tokens, cached_tokens)

    def wait_seconds(self, load: int, backlog_tokens: int = 0) -> float:
        """How long a worker holding `load` sequences, with `backlog_tokens` of prompts
        still to prefill, takes to start another: 0 when idle (new work wakes it), else
        one of its decode steps, plus its backlog's prefill (which goes first)."""
        if load <= 0:
            return 0.0
        step = self._model.predict(StepShape(num_decodes=load))
        return step + self.prefill_seconds(backlog_tokens, 0)

    def cost_seconds(self, num_tokens: int, place: Place) -> float:
        """Sequence-seconds the sequence costs at `place`: its wait, plus its prefill
        paid by itself and by each sequence already there."""
        prefill = self.prefill_seconds(num_tokens, place.cached_tokens)
        return place.wait_seconds + prefill * (1 + place.load)

    def step_seconds(self, load: int) -> float:
        """One decode step of a worker holding `load` sequences (its fixed cost when idle)."""
        return self._model.predict(StepShape(num_decodes=load))

    def prefers(self, num_tokens: int, here: Place, there: Place) -> bool:
        """Whether a `num_tokens` prompt costs less at `there` than `here`. Costs no
        further apart than one decode step of the busier place, or than either place's mean
        gap between calls, are a tie, and a tie goes to the place with the longer cached
        prefix: a place starts a sequence only at a step's boundary, after it calls, and its
        wait is priced as one predicted step, so a smaller difference is below what the
        price resolves, while the cached tokens are certainly not computed again."""
        there_cost = self.cost_seconds(num_tokens, there)
        here_cost = self.cost_seconds(num_tokens, here)
        if there.cached_tokens == here.cached_tokens:
            return there_cost < here_cost
        # One margin for both places, so that the asker and the place it prices agree on
        # which of them a tie goes to (each asking in turn, neither leaves the sequence to
        # the other); the gaps at most MAX_GAP_STEPS steps, so that one long gap (a
        # warm-up, a stall) does not make every difference a tie.
        step = self.step_seconds(max(here.load, there.load))
        gap = min(max(here.call_gap_seconds, there.call_gap_seconds), MAX_GAP_STEPS * step)
        tie = max(step, gap)
        if there.cached_tokens > here.cached_tokens:
            return there_cost <= here_cost + tie
        return there_cost < here_cost - tie
