"""Cache-aware placement in the pull design: which queued sequences the asking worker W
takes, and in what order, given where their prefixes are cached and how loaded the
fleet is (docs/policies.md, "Placement").

Late binding: nothing is routed on arrival. When W asks, for each candidate (the queue
order's) the rule compares what W has cached of its prompt with the best other
admitting worker that can run it (`FleetView.spread`), and prices the places with
`AffinityPrice` (policies/affinity.py): wait + uncached prefill x (1 + load), in
sequence-seconds, a place's wait being one of its decode steps and the prefill of its
backlog (0 when idle). A prefix hit is kept for its holder only when it pays; costs
within one decode step, or one of the places' gap between calls, are a tie, which goes
to the longer cached prefix (`AffinityPrice.prefers`).

1. **Overdue** (queued for `--aging-seconds` or more): W takes it if it fits; never
   deferred, and ranked first.
2. **A hit on W** (W alone holds its longest cached prefix): ranked before the others
   of its window. W takes it unless a less loaded worker runs it for less (a short hit
   on a busy W: its batch would carry most of the prefill anyway), or W is at its cap.
3. **Better elsewhere** (another worker holds a longer prefix): W leaves it for the
   holder only if the holder costs less than W (the saved prefill outweighs the wait
   and the holder's batch carrying the rest) and is below its cap; then for at most the
   time W would spend computing the tokens the holder has cached (W's step model's
   prediction, or the cautious default model's) or the holder's predicted wait, the
   longer, and while the holder has not asked since the candidate was queued, for up to
   its measured gap between calls (`CallGaps`: a step and a report's round trip, longer
   than the predicted step on fast steps); after that W takes it. When the
   holders tie among themselves and each of them would place it by load away from
   itself (4.), it is placed by load as a cold one.
4. **Cold** (cached nowhere) or a **tie** (another worker holds as long a prefix):
   placed by load. W takes it unless W holds at least its share of the fleet's work
   (the assigned and queued sequences over the admitting workers, rounded up) and a less
   loaded place would start it within one of W's steps (its wait, backlog included);
   for a tie a cold place must also cost less than W. Below its share W leaves only a
   prefill longer than a chunk, and only to a less loaded place that starts it within
   W's step and costs less (W's decodes would carry each of its chunks).

**Balance is a constraint**: the cap is W's share and a quarter (at least one more): no
worker waits for a holder at its cap, and a worker at its cap leaves a hit or a cold
sequence to any less loaded worker, whatever the price. A deferral for load (2., 4.)
lasts at most one of W's steps (a chunk's prefill): a less loaded worker that asks
meanwhile takes it.

A deferred candidate is skipped, not waited for: later ones still go ahead. Everything
is bounded: a deferral by its patience and by `--aging-seconds`, the reordering by
`LOOKAHEAD` candidates. The mechanism offers a `FleetView` only for a worker that keeps
a cache with --prefix-caching on; otherwise admissions are exactly the queue order's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from itertools import islice

from service.core.config import SchedulerConfig
from service.core.decide.fleet import CacheSpread, FleetView
from service.core.decide.plan import DecisionView
from service.core.decide.policies.affinity import AffinityPrice, Place
from service.core.learn.step_model import StepShape, StepTimeModel, chunk_attention
from service.core.vocabulary import PlacementPass, SequenceView

# Candidates at the head of the queue order that one decision ranks (reads the cache of):
# a hit passes at most this many cold sequences, and a decision looks up at most this
# many before it admits (then one more per candidate it reaches).
LOOKAHEAD = 16

_OVERDUE, _HIT, _OTHER = 0, 1, 2  # rank classes, best first
_TAKE: tuple[bool, PlacementPass | None] = (False, None)
_DEFER: tuple[bool, PlacementPass | None] = (True, None)


class PlacementRule:
    """The placement settings; `start` gives one decision's `Placement` (None: the
    mechanism offered no fleet view, so admissions keep the queue order)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self._aging_seconds = config.aging_seconds
        # The patience of a worker whose step time is not learned (no latency target).
        self._default_model = StepTimeModel()

    def start(self, view: DecisionView) -> Placement | None:
        if view.fleet is None:
            return None
        return Placement(
            view, view.fleet, self._aging_seconds, view.step_model or self._default_model
        )


class Placement:
    """One decision's placement: `candidates` in rank order, `place` for each."""

    def __init__(
        self, view: DecisionView, fleet: FleetView, aging_seconds: float, model: StepTimeModel
    ) -> None:
        self._view = view
        self._fleet = fleet
        self._aging_seconds = aging_seconds
        self._model = model
        self._price = AffinityPrice(model)
        # W's share of the fleet's work: assigned plus queued sequences, per admitting
        # worker (admissions only move sequences from the queue to W: it stays the same).
        self._fair_load = math.ceil((fleet.total_load + fleet.num_queued) / fleet.num_workers)
        # Balance is a constraint: no worker takes a sequence for its cache at this load
        # or more (its share and a quarter, at least one more), whatever the price.
        self._max_load = self._fair_load + max(1, self._fair_load // 4)

    def candidates(self) -> Iterator[SequenceView]:
        """The queue order's candidates, the first LOOKAHEAD of them ranked (overdue,
        then W's hits, then the rest, queue order within)."""
        queue = self._view.queue()
        window = list(islice(queue, LOOKAHEAD))
        window.sort(key=self._rank)
        yield from window
        yield from queue

    def place(self, seq: SequenceView, num_admitted: int) -> tuple[bool, PlacementPass | None]:
        """Whether W leaves `seq` queued this decision, for a better placed worker
        (`num_admitted`: what W admitted so far in this decision, its load grows); and
        when W would take it though another worker holds a longer prefix of it, the rule
        that let W take it (None: W holds as long a prefix as any, nobody holds one, or
        it is overdue: `overdue_pass`, asked only of what W admits)."""
        fleet = self._fleet
        waited = fleet.waited_seconds(seq)
        if waited >= self._aging_seconds:
            return _TAKE  # its cache is not looked up: overdue_pass, once admitted
        spread = fleet.spread(seq)
        own, other = spread.own_tokens, spread.best_other_tokens
        load = fleet.own_load + num_admitted
        num_tokens = seq.num_tokens()
        here = Place(own, load, 0.0, fleet.own_mean_call_gap_seconds)
        # 4. places it by load when every holder would (below): W's pass, if W takes it.
        passed = None
        if other > own:
            if self._holders_leave_it(spread, load):
                passed = PlacementPass.HOLDERS_BUSY
            else:
                return self._better_elsewhere(seq, spread, here, waited)
        # At most one of W's steps: a less loaded worker that asks meanwhile takes it.
        patience = self._step_seconds(own, min(num_tokens - own, self._view.chunk_size))
        if own > other:
            # 2. W's alone: W keeps it unless a less loaded worker runs it for less (W's
            # batch carrying a prefill that a small hit barely shortens), or W is at its
            # cap.
            peer = self._least_loaded(seq, spread, alone=True)
            if peer is None or peer.load >= load:
                return _TAKE
            if load < self._max_load and not self._price.prefers(num_tokens, here, peer):
                return _TAKE
            return waited < patience, None
        # 4. Cold or a tie: placed by load. W leaves it to the least loaded place that
        # would start it within W's step (not one busy with a backlog of prefill): below
        # W's share only a prefill longer than a chunk (W's decodes would carry it for
        # several steps, which sets their TPOT) and only if that place runs it for less;
        # from the share on whatever the price, except that a tie goes to a cold place
        # only if that runs it for less; at W's cap to any less loaded place.
        below_share = load < self._fair_load
        if below_share and num_tokens - own <= self._view.chunk_size:
            return False, passed
        peer = self._least_loaded(seq, spread, alone=False)
        if peer is None or peer.load >= load:
            return False, passed
        if load < self._max_load:
            if peer.wait_seconds >= patience:
                return False, passed
            priced = below_share or peer.cached_tokens < own
            if priced and not self._price.prefers(num_tokens, here, peer):
                return False, passed
        return (True, None) if waited < patience else (False, passed)

    def overdue_pass(self, seq: SequenceView) -> PlacementPass | None:
        """OVERDUE if W admits `seq` only because it is overdue, with a longer prefix of it
        cached elsewhere; else None."""
        fleet = self._fleet
        if fleet.waited_seconds(seq) < self._aging_seconds:
            return None
        spread = fleet.spread(seq)
        return PlacementPass.OVERDUE if spread.best_other_tokens > spread.own_tokens else None

    def _better_elsewhere(
        self, seq: SequenceView, spread: CacheSpread, here: Place, waited: float
    ) -> tuple[bool, PlacementPass | None]:
        """3. Another worker holds a longer prefix: waiting for that holder must pay (its
        saved prefill against the wait and its batch carrying the rest), and never past
        the holder's cap."""
        holder = self._place(spread.best_other_holder, spread.best_other_tokens)
        if holder.load >= self._max_load:
            return False, PlacementPass.HOLDER_AT_CAP
        if not self._price.prefers(seq.num_tokens(), here, holder):
            return False, PlacementPass.CHEAPER_HERE
        # For the saved prefill's time, or until the holder's predicted start if later
        # (the price already said that wait pays).
        saved = spread.best_other_tokens - spread.own_tokens
        if waited < max(self._step_seconds(spread.own_tokens, saved), holder.wait_seconds):
            return _DEFER
        # Those are step times; the holder asks again after its step, its report's round
        # trip and its wake-up, longer on fast steps: until it has asked once since `seq`
        # was queued, for at most its measured gap between calls.
        holder_id = spread.best_other_holder
        fleet = self._fleet
        if (
            holder_id is not None
            and not fleet.called_since_queued(holder_id, seq)
            and waited < fleet.call_gap_seconds(holder_id)
        ):
            return _DEFER
        return False, PlacementPass.WAITED_OUT

    def _least_loaded(self, seq: SequenceView, spread: CacheSpread, *, alone: bool) -> Place | None:
        """The least loaded other place for `seq`: another holder of W's prefix (a tie)
        when one is the least loaded, else the least loaded worker, counted as cold."""
        if not alone:
            holder = spread.best_other_least_load
            least = self._fleet.least_peer_load(seq.adapter_id)
            if holder is not None and (least is None or holder <= least):
                return self._place(spread.best_other_holder, spread.best_other_tokens)
        worker_id = self._fleet.least_loaded_peer(seq.adapter_id)
        return None if worker_id is None else self._place(worker_id, 0)

    def _place(self, worker_id: str | None, cached_tokens: int) -> Place:
        """Another worker as a place: its load, its wait (a step, and its backlog) and its
        mean gap between calls."""
        if worker_id is None:
            return Place(cached_tokens, 0)
        fleet = self._fleet
        load = fleet.load(worker_id)
        wait = self._price.wait_seconds(load, fleet.backlog_tokens(worker_id))
        return Place(cached_tokens, load, wait, fleet.mean_call_gap_seconds(worker_id))

    def _holders_leave_it(self, spread: CacheSpread, load: int) -> bool:
        """Whether two or more others hold the best prefix and each would leave it by
        load (4.): every one with room holds at least its share and more than W."""
        least = spread.best_other_least_load
        return (
            spread.best_other_holders > 1
            and least is not None
            and least >= max(self._fair_load, load + 1)
        )

    def _rank(self, seq: SequenceView) -> int:
        fleet = self._fleet
        if fleet.waited_seconds(seq) >= self._aging_seconds:
            return _OVERDUE
        spread = fleet.spread(seq)
        saved = spread.own_tokens - spread.best_other_tokens
        if spread.own_tokens and saved >= 0:
            return _HIT
        return _OTHER

    def _step_seconds(self, start: int, num_tokens: int) -> float:
        """W's predicted time for a step that prefills `num_tokens` from `start`."""
        return self._model.predict(
            StepShape(
                num_prefill_tokens=num_tokens, prefill_attention=chunk_attention(start, num_tokens)
            )
        )
