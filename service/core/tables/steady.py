"""What a worker's steady step needs, kept from the step before it (issue 21).

A worker decoding a fixed set of sequences sends the same report every step but for
one new token each: the same packed runs, offsets one higher. The Reconciler keeps the
runs it applied one by one (`SteadyRuns`, on the WorkerRecord), checks the next report
against them with list comparisons in C and applies its tokens with one append each; the
Batcher keeps beside them what its pass over the running sequences found, and skips
the pass while the step stays steady.
"""
from __future__ import annotations

from array import array
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from service.core.tables.sequences import Sequence


@dataclass(slots=True)
class SteadyRuns:
    """A worker's latest packed runs that gave each sequence they named one token, with
    what applying the same step again needs: the next such report is then checked with
    list comparisons in C and applied with one append per token, no pass per sequence
    in Python (WorkerRecord.steady_runs).

    It holds while the same records stay assigned to the worker under the same
    admissions: `seqs` is compared by identity with what `assigned` holds for `seq_ids`
    (a sequence that left is None there, a restored one another record), and the
    Batcher drops it at every admission to the worker (offsets count from 0 again).
    Tokens are added to these sequences only by this worker's reports, so `num_known`
    stays right as long as it is updated with each step applied from it.
    """

    seq_ids: Collection[int]
    seqs: list[Sequence]
    outputs: list[array]  # each one's output_token_ids
    num_known: list[int]  # each one's tokens since its admission: the next offsets
    grown: dict[int, Sequence]
    ones: list[int]  # one token each, as the observer hears it
    served: dict[str, int]  # tokens per tenant of one such step
    # Steady steps applied from it since `page_residues` was set.
    num_steps: int = 0
    # The Batcher's part (Batcher._steady_running), set by a decision whose report ran
    # exactly these sequences in this order, all DECODING: the report's running ids, the
    # records, and how many of them had each residue of (tokens - 1) % page_size then.
    # Each steady step adds one token to every one of them, so the number that start a
    # page at the next decode is page_residues[-num_steps % page_size].
    running_ids: Collection[int] | None = None
    running_seqs: tuple[Sequence, ...] = ()
    page_residues: list[int] | None = None
