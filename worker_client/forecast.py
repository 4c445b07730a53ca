"""What the engine will hold once the step in flight ends: the report of an overlapped loop.

With overlapped iterations the worker reports for iteration n+1 while the engine still
runs iteration n, so the report describes the engine as it will be after step n:

- a prefill chunk that completes its prompt moves the sequence from waiting to running;
- a new admission (a chunk with a spec) is held from then on and takes a GDN slot;
- the KV pages step n fills are taken off the free count, from the tokens each held
  sequence has in cache: its prompt as far as prefilled, plus one per decode (how a paged
  KV cache grows, in the reference engine and the scripted one alike); an admission that
  resumes from the prefix cache is counted as if it computed from 0 (its shared pages
  may have been free), which errs low.

What only the step can tell is not foreseen: a sequence that finishes (EOS, a stop token,
its last token) or that the engine preempts is reported as held one iteration longer; the
scheduler may then schedule it once more, and the engine drops what it no longer holds,
without a token. The free counts err low (pages and slots freed by step n show a report
later), never high.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from worker_client.engine.api import ChunkWork


@dataclass(frozen=True)
class Holding:
    """What an engine holds: the ids of a report, and its free pages and slots."""

    waiting: tuple[int, ...]
    running: tuple[int, ...]
    kv_free_pages: int
    gdn_free_slots: int
    kv_cached_pages: int = 0  # of kv_free_pages, those holding reusable prefix cache

    @property
    def is_empty(self) -> bool:
        return not self.waiting and not self.running


@dataclass
class _Length:
    prompt_len: int
    num_cached: int  # tokens in the KV cache


class Forecast:
    """Tracks each held sequence's length across steps, to foresee the next holding."""

    def __init__(self, page_size: int) -> None:
        self._page_size = page_size
        self._lengths: dict[int, _Length] = {}

    def after_step(
        self, now: Holding, prefill: Sequence[ChunkWork], decode: Sequence[int]
    ) -> Holding:
        """The holding after a step of `prefill` and `decode` from `now`; remembers the
        lengths it foresees, for the next call."""
        # Dicts as ordered sets: the report keeps the engine's order, new admissions last.
        waiting, running = dict.fromkeys(now.waiting), dict.fromkeys(now.running)
        self._lengths = {s: n for s, n in self._lengths.items() if s in waiting or s in running}
        kv_free, gdn_free = now.kv_free_pages, now.gdn_free_slots
        for chunk in prefill:
            seq_id = chunk.seq_id
            if chunk.spec is not None:
                if seq_id in waiting or seq_id in running:  # a re-admission replaces it
                    kv_free += self._pages(self._lengths.get(seq_id))
                    waiting.pop(seq_id, None)
                    running.pop(seq_id, None)
                else:
                    gdn_free -= 1
                self._lengths[seq_id] = _Length(len(chunk.spec.prompt_token_ids), 0)
                waiting[seq_id] = None
            elif seq_id not in waiting:
                continue  # not held, or prefilled already: the engine skips it
            length = self._lengths.get(seq_id)
            if length is None:  # held from before we tracked it: assume the worst
                kv_free -= math.ceil(chunk.chunk_len / self._page_size) + 1
                continue
            end = min(chunk.chunk_start + chunk.chunk_len, length.prompt_len)
            kv_free -= self._grow(length, end - length.num_cached)
            if length.num_cached >= length.prompt_len:
                del waiting[seq_id]
                running[seq_id] = None
        for seq_id in decode:
            if seq_id in running:
                length = self._lengths.get(seq_id)
                kv_free -= 1 if length is None else self._grow(length, 1)
        # Pages a step takes may be cached ones (reclaimed): never more cached than free.
        kv_free = max(0, kv_free)
        return Holding(
            tuple(waiting),
            tuple(running),
            kv_free,
            max(0, gdn_free),
            min(now.kv_cached_pages, kv_free),
        )

    def _grow(self, length: _Length, num_tokens: int) -> int:
        """Pages `num_tokens` more tokens take; the length is updated."""
        if num_tokens <= 0:
            return 0
        before = self._pages(length)
        length.num_cached += num_tokens
        return self._pages(length) - before

    def _pages(self, length: _Length | None) -> int:
        return 0 if length is None else math.ceil(length.num_cached / self._page_size)
