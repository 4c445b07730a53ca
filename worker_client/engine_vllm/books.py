"""What a vLLM worker reports of vLLM's one block pool, and its resume points.

vLLM keeps one pool of blocks for a hybrid model: the attention group takes one block per
`block_size` tokens of a sequence, and each GDN layer's Mamba group takes blocks for that
layer's recurrent state. The contract counts KV pages and GDN state slots apart, so the
pool is split in the books (nothing is split in vLLM):
- `total_gdn_slots` S is vLLM's `max_num_seqs`; each slot sets aside `blocks_per_state`
  blocks of every Mamba group (1 without prefix caching; 2 in vLLM's `align` mode, where a
  prefill chunk writes the state of its block boundary into a block of its own);
- `total_kv_pages` is the rest: all usable blocks minus S * blocks per slot;
- `kv_free_pages` is vLLM's free blocks (evictable cached blocks included, as the contract
  counts them) minus what the Mamba groups may still take for the slots: S * blocks per
  slot minus the Mamba blocks held now;
- `gdn_free_slots` is S minus the sequences held.
So a sequence admitted against these numbers always finds its blocks: the Lattice
scheduler's admission guard keeps vLLM from preempting on its own. If vLLM preempts
anyway, the engine reports it as a preemption.

Resume points: after each step, every full block boundary a held sequence has computed is a
candidate, named by the contract's block hash (common/block_hash.py, over the sequence's
tokens); it is a resume point while vLLM's own cache lookup (its block hashes, all groups:
attention blocks and the GDN state at that boundary) hits exactly that far.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.block_hash import block_hashes
from worker_client.engine.api import CacheDelta
from worker_client.engine.resume_points import ResumePointLog


@dataclass
class PoolBooks:
    """The split of vLLM's block pool into KV pages and GDN slots (module docstring)."""

    num_usable_blocks: int  # the pool's blocks but vLLM's null block
    num_mamba_groups: int
    blocks_per_state: int
    total_gdn_slots: int

    @property
    def blocks_per_slot(self) -> int:
        return self.num_mamba_groups * self.blocks_per_state

    @property
    def total_kv_pages(self) -> int:
        return self.num_usable_blocks - self.total_gdn_slots * self.blocks_per_slot

    def kv_free_pages(self, num_free_blocks: int, num_mamba_blocks_held: int) -> int:
        set_aside = max(0, self.total_gdn_slots * self.blocks_per_slot - num_mamba_blocks_held)
        return max(0, num_free_blocks - set_aside)


@dataclass
class _Candidate:
    vllm_hashes: list  # vLLM's block hashes of tokens [0, num_tokens)
    num_tokens: int


@dataclass
class ResumePoints:
    """The contract's resume points of a vLLM prefix cache (module docstring)."""

    block_tokens: int
    hash_block_tokens: int  # tokens per vLLM block hash (block_tokens or a divisor)
    # The most points the registration lets it report (docs/contract.md: its KV pages'
    # blocks, at most one per snapshot slot); 0: no bound. vLLM may cache more in its free
    # blocks: the oldest beyond the bound are not reported (a hit lost, never a wrong one).
    max_points: int = 0
    _known: dict[int, _Candidate] = field(default_factory=dict)
    _log: ResumePointLog = field(default_factory=ResumePointLog)
    _unchecked: list[int] = field(default_factory=list)  # noted since the last delta

    def note(self, request, contract_hashes: list[int]) -> None:
        """Extend `contract_hashes` (the request's, h_0 first) to its computed full blocks
        and take each new one as a candidate."""
        num_blocks = request.num_computed_tokens // self.block_tokens
        if num_blocks <= len(contract_hashes):
            return
        tokens = list(request.all_token_ids[: num_blocks * self.block_tokens])
        start = len(contract_hashes)
        contract_hashes += block_hashes(
            tokens,
            "",
            self.block_tokens,
            start_block=start,
            previous_hash=contract_hashes[-1] if contract_hashes else 0,
        )
        per_block = self.block_tokens // self.hash_block_tokens
        for i in range(start, num_blocks):
            if contract_hashes[i] not in self._known:
                num_tokens = (i + 1) * self.block_tokens
                hashes = list(request.block_hashes[: (i + 1) * per_block])
                self._known[contract_hashes[i]] = _Candidate(hashes, num_tokens)
                self._log.add(contract_hashes[i])
                self._unchecked.append(contract_hashes[i])

    def delta(self, hit_length, full: bool = False, evicted: bool = True) -> CacheDelta:
        """Drop the candidates vLLM no longer hits (`hit_length(vllm_hashes, num_tokens)`),
        then the changes since the last call (with `full`, a reset listing all).
        `evicted`: whether vLLM may have dropped cached blocks since the last call; when
        not, a hit cannot have shrunk, so only the candidates noted since are looked up
        (a lookup per candidate and iteration would grow with the cache)."""
        checked = list(self._known) if evicted or full else self._unchecked
        self._unchecked = []
        for block_hash in checked:
            candidate = self._known.get(block_hash)
            if candidate is None:
                continue
            if len(candidate.vllm_hashes) * self.hash_block_tokens < candidate.num_tokens or (
                hit_length(candidate.vllm_hashes, candidate.num_tokens) < candidate.num_tokens
            ):
                del self._known[block_hash]
                self._log.remove(block_hash)
        if self.max_points:
            for block_hash in list(self._known)[: max(0, len(self._known) - self.max_points)]:
                del self._known[block_hash]
                self._log.remove(block_hash)
        if full:
            self._log.reset(list(self._known))
        return self._log.take()

    def tokens_of(self, block_hash: int) -> int | None:
        candidate = self._known.get(block_hash)
        return None if candidate is None else candidate.num_tokens
