"""Routers on arrival: the gateway designs the pull scheduler is measured against.

With a router, each worker has a scheduler (a queue) of its own and a request goes to one
of them when it arrives, as in the systems these follow; the worker's scheduler then
uses that worker's own prefix cache only. What a router sees of the fleet is a
`FleetView` the simulator keeps:
- `cached_blocks(w, hashes)`: how many leading blocks of a prompt worker w has cached,
  from the cache events (resume points added and removed) w reported, as precise KV
  events give them to Dynamo's router and llm-d's precise prefix scorer;
- the load the router itself tracks of what it routed (outstanding requests, their
  blocks, their prefill not yet done) and what a worker's metrics say (waiting
  requests, KV usage), read when the request arrives (no scrape delay).

The routers (docs/simulation.md names the source followed for each and its assumptions):
- `round-robin`, `least-loaded` (fewest outstanding requests);
- `kv-router`: NVIDIA Dynamo's KV router, cost = overlap weight (1.0) x prefill blocks the
  worker would have (its active prefill tokens + this prompt's uncached tokens, over the
  block size) + the decode blocks it would have (its active blocks + this prompt's);
  the lowest cost wins (temperature 0);
- `prefix-load`: llm-d's endpoint picker with its precise-prefix profile: scores in
  [0, 1] weighted 2 (prefix: cached blocks / prompt blocks), 1 (KV utilisation:
  1 - usage) and 1 (queue: (max - own) / (max - min) waiting, 1 when all equal); the
  highest sum wins;
- `cache-aware`: SGLang's router: when the outstanding requests are imbalanced (max - min
  > 64 and max > 1.5 x min) the least loaded; otherwise the worker whose approximate
  tree (the prompts routed to it) matches most, if it matches more than 0.3 of the
  prompt, else the worker with the smallest tree. The routed prompt joins the chosen
  worker's tree either way.
Ties go to a seeded random choice among the tied (the pickers of these systems leave
ties to map order or a shuffle).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

ROUTINGS = ("pull", "round-robin", "least-loaded", "kv-router", "prefix-load", "cache-aware")
# Routings that need the workers' caches (a prompt's block hashes) to decide.
CACHE_ROUTINGS = ("kv-router", "prefix-load", "cache-aware")

# Dynamo's --kv-overlap-score-weight default.
KV_OVERLAP_SCORE_WEIGHT = 1.0
# llm-d's precise-prefix profile weights (deploy/config/epp-precise-prefix-cache-config.yaml).
PREFIX_SCORER_WEIGHT = 2.0
KV_UTILIZATION_SCORER_WEIGHT = 1.0
QUEUE_SCORER_WEIGHT = 1.0
# SGLang router defaults (cache_threshold, balance_abs_threshold, balance_rel_threshold).
CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5


class FleetView(Protocol):
    """What a router may read of worker `w` when a request arrives."""

    num_workers: int
    block_tokens: int  # the workers' cache block (tokens)

    def cached_blocks(self, w: int, hashes: Sequence[int]) -> int: ...

    def num_outstanding(self, w: int) -> int: ...

    def num_waiting(self, w: int) -> int: ...

    def kv_usage(self, w: int) -> float: ...

    def active_blocks(self, w: int) -> int: ...

    def active_prefill_tokens(self, w: int) -> int: ...


class Router(Protocol):
    def pick(self, fleet: FleetView, prompt_len: int, hashes: Sequence[int]) -> int:
        """The worker that takes a request of `prompt_len` tokens whose full blocks hash to
        `hashes`."""
        ...


def make_router(routing: str, seed: int) -> Router:
    rng = random.Random(seed)
    routers = {
        "round-robin": RoundRobin,
        "least-loaded": LeastLoaded,
        "kv-router": KvRouter,
        "prefix-load": PrefixLoad,
        "cache-aware": CacheAware,
    }
    if routing not in routers:
        raise ValueError(f"--routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    return routers[routing](rng)


def _best(scores: Sequence[float], rng: random.Random, *, lowest: bool) -> int:
    target = min(scores) if lowest else max(scores)
    tied = [w for w, s in enumerate(scores) if s == target]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


class RoundRobin:
    def __init__(self, rng: random.Random) -> None:
        self._next = 0

    def pick(self, fleet: FleetView, prompt_len: int, hashes: Sequence[int]) -> int:
        w = self._next % fleet.num_workers
        self._next += 1
        return w


class LeastLoaded:
    """Fewest outstanding requests; the lowest index among the tied."""

    def __init__(self, rng: random.Random) -> None:
        pass

    def pick(self, fleet: FleetView, prompt_len: int, hashes: Sequence[int]) -> int:
        return min(range(fleet.num_workers), key=lambda w: (fleet.num_outstanding(w), w))


class KvRouter:
    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(self, fleet: FleetView, prompt_len: int, hashes: Sequence[int]) -> int:
        b = fleet.block_tokens
        request_blocks = -(-prompt_len // b)
        costs = []
        for w in range(fleet.num_workers):
            uncached = prompt_len - fleet.cached_blocks(w, hashes) * b
            prefill_blocks = (fleet.active_prefill_tokens(w) + uncached) / b
            decode_blocks = fleet.active_blocks(w) + request_blocks
            costs.append(KV_OVERLAP_SCORE_WEIGHT * prefill_blocks + decode_blocks)
        return _best(costs, self._rng, lowest=True)


class PrefixLoad:
    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(self, fleet: FleetView, prompt_len: int, hashes: Sequence[int]) -> int:
        workers = range(fleet.num_workers)
        waiting = [fleet.num_waiting(w) for w in workers]
        most, least = max(waiting), min(waiting)
        scores = []
        for w in workers:
            prefix = fleet.cached_blocks(w, hashes) / len(hashes) if hashes else 0.0
            queue = 1.0 if most == least else (most - waiting[w]) / (most - least)
            scores.append(
                PREFIX_SCORER_WEIGHT * prefix
                + KV_UTILIZATION_SCORER_WEIGHT * (1.0 - fleet.kv_usage(w))
                + QUEUE_SCORER_WEIGHT * queue
            )
        return _best(scores, self._rng, lowest=False)


class CacheAware:
    """SGLang's router over an approximate tree per worker: the blocks of the prompts
    routed there (a set of chained block hashes is a prefix tree), in tokens."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._trees: list[set[int]] = []
        self._tree_tokens: list[int] = []

    def pick(self, fleet: FleetView, prompt_len: int, hashes: Sequence[int]) -> int:
        n = fleet.num_workers
        if not self._trees:
            self._trees = [set() for _ in range(n)]
            self._tree_tokens = [0] * n
        loads = [fleet.num_outstanding(w) for w in range(n)]
        most, least = max(loads), min(loads)
        if most - least > BALANCE_ABS_THRESHOLD and most > least * BALANCE_REL_THRESHOLD:
            w = min(range(n), key=lambda i: (loads[i], i))
        else:
            matched = [self._match(w, hashes) for w in range(n)]
            best = max(matched)
            rate = best * fleet.block_tokens / prompt_len
            if rate > CACHE_THRESHOLD:
                w = _best(matched, self._rng, lowest=False)
            else:
                w = _best(self._tree_tokens, self._rng, lowest=True)
        self._insert(w, hashes, fleet.block_tokens)
        return w

    def _match(self, w: int, hashes: Sequence[int]) -> int:
        tree = self._trees[w]
        n = 0
        for h in hashes:
            if h not in tree:
                break
            n += 1
        return n

    def _insert(self, w: int, hashes: Sequence[int], block_tokens: int) -> None:
        tree = self._trees[w]
        for h in hashes:
            if h not in tree:
                tree.add(h)
                self._tree_tokens[w] += block_tokens
