#!/usr/bin/env python3
"""Where a pull run's prefix reuse goes (docs/simulation.md, "Where the reuse goes").

Runs `lattice-scheduler simulate` in process with the given flags (a Mooncake trace,
--routing pull) and watches every admission: the tokens the asking worker had cached
(what it reused), the longest prefix any worker had cached then, and the longest any
worker had ever reported. Prints, as fractions of all prompt tokens: what was reused;
what was lost by admitting away from a longer prefix (split by whether a holder had
room); what was lost because every copy had been evicted; how many workers held each
admission's best prefix; and how many cached blocks were copies (held by several
workers). Example:

    .venv/bin/python -m bench.placement_losses --trace mooncake_conversation \\
        --block-tokens 64 --num-requests 2000 --workers 4 --qps 8
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass

from service.core.cache import prefix_cache
from service.core.decide import batcher
from service.core.decide.fleet import has_room


@dataclass
class Admission:
    num_tokens: int
    reused: int  # tokens the asker had cached
    best: int  # the longest cached on any worker at that moment
    ever: int  # the longest any worker had ever reported
    holder_had_room: bool | None  # None: the asker held the best (or nobody did)
    num_holders: int


def watch() -> tuple[list[Admission], list[tuple[int, int]]]:
    """Patch the core's admission and the fleet index to record; returns the lists they
    fill: admissions, and (blocks held over all workers, distinct blocks) samples."""
    admissions: list[Admission] = []
    samples: list[tuple[int, int]] = []
    ever: set[int] = set()
    add = prefix_cache.FleetCache.add

    def recording_add(self, block_hash, worker_id):
        ever.add(block_hash)
        add(self, block_hash, worker_id)

    first_chunk = batcher.Batcher._first_chunk

    def recording_first_chunk(self, worker, seq, chunk_len, cached_tokens):
        b = worker.resume_points.block_tokens
        if b and seq.may_use_prefix_cache():
            n = seq.num_tokens()
            seq.prompt_hashes = prefix_cache.prompt_hashes(
                seq.prompt_hashes, seq.resume_token_ids, n, seq.adapter_id, b
            )
            hashes, owners = seq.prompt_hashes.hashes, self._ledger.fleet_cache.owners
            usable = min(len(hashes), (n - 1) // b)
            best, holders = 0, set()
            for i in range(usable - 1, -1, -1):
                if hashes[i] in owners:
                    best, holders = (i + 1) * b, owners[hashes[i]]
                    break
            seen = next(((i + 1) * b for i in range(usable - 1, -1, -1) if hashes[i] in ever), 0)
            room = None
            if holders and worker.worker_id not in holders:
                room = any(has_room(w) for w in self._ledger if w.worker_id in holders)
            if len(admissions) % 50 == 0:
                samples.append(
                    (sum(len(w.resume_points.points) for w in self._ledger), len(owners))
                )
            admissions.append(Admission(n, cached_tokens, best, seen, room, len(holders)))
        return first_chunk(self, worker, seq, chunk_len, cached_tokens)

    prefix_cache.FleetCache.add = recording_add
    batcher.Batcher._first_chunk = recording_first_chunk
    return admissions, samples


def main() -> int:
    from service.cli.main import main as cli

    admissions, samples = watch()
    rc = cli(["simulate", "--no-progress", *sys.argv[1:]])
    if rc or not admissions:
        return rc or 1
    total = sum(a.num_tokens for a in admissions)

    def share(values) -> str:
        return f"{sum(values) / total:.3f}"

    away = [a for a in admissions if a.best > a.reused]
    print(f"\n{len(admissions)} admissions, {total} prompt tokens; as shares of them:")
    print(f"  reused on the admitting worker      {share(a.reused for a in admissions)}")
    print(f"  cached on some worker at admission  {share(a.best for a in admissions)}")
    print(f"  ever reported by some worker        {share(a.ever for a in admissions)}")
    for label, room in (("a holder had room", True), ("no holder had room", False)):
        lost = [a for a in away if a.holder_had_room is room]
        print(
            f"  lost admitting away from a longer prefix, {label}: {len(lost)} admissions, "
            f"{share(a.best - a.reused for a in lost)}"
        )
    print(f"  lost because every copy was evicted {share(a.ever - a.best for a in admissions)}")
    holders = Counter(a.num_holders for a in admissions if a.best)
    print(
        "  workers holding an admission's best prefix: "
        + ", ".join(f"{k}: {v}" for k, v in sorted(holders.items()))
    )
    late = samples[len(samples) // 4 :]
    held, distinct = sum(h for h, _ in late), sum(d for _, d in late)
    print(
        f"  cached blocks (after the first quarter, mean): {held / len(late):.0f} held over "
        f"all workers, {distinct / len(late):.0f} distinct ({held / max(1, distinct):.3f} "
        f"copies each)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
