"""The prefix hit rate's bound: what one worker holding the whole fleet's cache memory
would reuse on the same requests.

One LRU cache of `num_blocks` blocks, the requests in arrival order, nothing else
competing for its memory (no running sequence holds pages, no snapshot limit): each
prompt reuses its longest cached prefix of full blocks strictly below its end, then all
its full blocks are cached, its first block the most recently used (as the engine
releases them). Prompt tokens only (generated blocks are never reused by a trace's
next prompt here: their token ids are simulated).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from common.block_hash import block_hashes
from service.sim.workload import Request, prompt_token_ids


def hit_rate_bound(requests: Iterable[Request], *, block_tokens: int, num_blocks: int) -> float:
    """Reused prompt tokens / all prompt tokens, for an LRU of `num_blocks` blocks of
    `block_tokens` tokens."""
    cache: OrderedDict[int, None] = OrderedDict()
    reused = total = 0
    for request in sorted(requests, key=lambda r: (r.arrival_seconds, r.index)):
        token_ids = prompt_token_ids(request)
        hashes = block_hashes(token_ids, "", block_tokens)
        usable = (request.prompt_len - 1) // block_tokens
        num_hit = 0
        while num_hit < usable and hashes[num_hit] in cache:
            num_hit += 1
        reused += num_hit * block_tokens
        total += request.prompt_len
        for h in reversed(hashes):
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > num_blocks:
            cache.popitem(last=False)
    return reused / total if total else 0.0
