"""The prefix hit rate's bound: what one worker holding the whole fleet's cache memory
would reuse on the same requests.

One LRU cache of `num_blocks` blocks, the requests in arrival order, nothing else
competing for its memory (no running sequence holds pages, no snapshot limit): each
prompt reuses its longest cached prefix of full blocks strictly below its end, then all
its full blocks are cached, its first block the most recently used (as the engine
releases them). Prompt tokens only are ever reused (a trace's next prompt never
contains a simulated answer: its token ids are made up here).

Two bounds, printed side by side (docs/simulation.md, "Outputs"):
- `cache_generated=False`: the cache keeps prompt blocks only, an ideal no worker's
  cache follows;
- `cache_generated=True`: the cache keeps every full block of the sequence as the
  workers' caches do (the engines cache a sequence's generated blocks too, for a next
  turn that would contain the answer), older than its prompt's. In a simulation those
  blocks are never reused, but they take the same memory in one big cache as in the
  fleet's: this is the bound on the workers' own cache rule, the one placement can be
  held to.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

from common.block_hash import block_hashes
from service.sim.workload import Request, prompt_token_ids


def hit_rate_bound(
    requests: Iterable[Request],
    *,
    block_tokens: int,
    num_blocks: int,
    cache_generated: bool = False,
) -> float:
    """Reused prompt tokens / all prompt tokens, for an LRU of `num_blocks` blocks of
    `block_tokens` tokens (with `cache_generated`, a sequence's generated full blocks
    take room in it too, as the workers' caches keep them)."""
    cache: OrderedDict[Hashable, None] = OrderedDict()
    reused = total = 0
    for request in sorted(requests, key=lambda r: (r.arrival_seconds, r.index)):
        token_ids = prompt_token_ids(request)
        hashes: list[Hashable] = list(block_hashes(token_ids, "", block_tokens))
        usable = (request.prompt_len - 1) // block_tokens
        num_hit = 0
        while num_hit < usable and hashes[num_hit] in cache:
            num_hit += 1
        reused += num_hit * block_tokens
        total += request.prompt_len
        if cache_generated:
            # The blocks the sequence completes while it decodes (its last token's KV is
            # never computed): unique to it, released before its prompt's.
            num_full = (request.prompt_len + request.output_len - 1) // block_tokens
            hashes += [(request.index, i) for i in range(len(hashes), num_full)]
        for h in reversed(hashes):
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > num_blocks:
            cache.popitem(last=False)
    return reused / total if total else 0.0
