"""Plain domain types shared by the scheduling core and its adapters.

Nothing here knows about gRPC or Prometheus: the servicer converts wire messages
to these types (service/server/convert.py) and back.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field


class FinishReason(enum.Enum):
    """Why a sequence stopped; values match the wire enum's numbers."""

    EOS = 1
    MAX_LENGTH = 2
    STOP = 3
    CANCELLED = 4
    PREEMPTED = 5
    FAILED = 6


class WorkerRole(enum.Enum):
    """What a worker runs; values match the wire enum's numbers (0, unset, reads BOTH)."""

    BOTH = 1  # prompts and decodes: today's behaviour, the default
    PREFILL = 2  # prompts only; each decode is handed off to a decode-capable worker
    DECODE = 3  # decodes only: sequences arrive prefilled, by handoff

    @property
    def prefills(self) -> bool:
        return self is not WorkerRole.DECODE

    @property
    def decodes(self) -> bool:
        return self is not WorkerRole.PREFILL


class SequenceState(enum.Enum):
    """Where a sequence is in its life; values match the wire enum's numbers."""

    QUEUED = 1
    PREFILLING = 2
    DECODING = 3
    FINISHED = 4


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How a worker picks each next token (temperature 0 means greedy)."""

    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    seed: int = 0
    # Log-probabilities of each generated token and of this many alternatives (0 = none).
    logprobs: int = 0
    # The same for every prompt token after the first (0 = none).
    prompt_logprobs: int = 0
    ignore_eos: bool = False  # EOS does not end the sequence
    min_new_tokens: int = 0  # EOS and stop tokens do not end it before this many tokens

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs > 0 or self.prompt_logprobs > 0


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The log-probability of one token and of the most likely tokens at its position."""

    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class SubmitParams:
    """A client's request for one sequence, as received.

    `prompt_token_ids` may be any sequence of ints; the core keeps it as a compact
    array('I') (4 bytes a token) once the sequence is accepted.
    """

    prompt_token_ids: Sequence[int]
    max_new_tokens: int
    request_id: str = ""
    adapter_id: str = ""
    priority: int = 0
    tenant: str = ""
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: tuple[int, ...] = ()
    # Who submitted it (the edge's principal; "" without authentication): request_id is
    # scoped by it, and only it (or a caller that sees all) may read or cancel it.
    principal: str = ""


@dataclass(frozen=True, slots=True)
class Caller:
    """Who makes a client call, as the edge authenticated it: the principal whose
    sequences it may read, stream and cancel, or (`sees_all`: admin, the scheduler's own
    calls, a scheduler without authentication) every sequence."""

    principal: str = ""
    sees_all: bool = False

    def may_see(self, principal: str) -> bool:
        """Whether a sequence submitted by `principal` exists for this caller."""
        return self.sees_all or principal == self.principal


# A caller that sees every sequence: the scheduler's own calls (a client that left, a
# cancel another replica asked for), and every call where no authentication is set up.
SEES_ALL = Caller(sees_all=True)


@dataclass(frozen=True, slots=True)
class SequenceSpec:
    """Everything a worker needs to (re)start a sequence from token 0.

    After a requeue, `prompt_token_ids` is the original prompt followed by the
    tokens generated so far and `max_new_tokens` what remains, so the resumed
    sequence continues where it stopped.
    """

    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    adapter_id: str
    sampling: SamplingParams
    stop_token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SubmitResult:
    """The accepted sequence and how many sequences were ahead of it."""

    seq_id: int
    queue_position: int


@dataclass(frozen=True, slots=True)
class WorkerRegistration:
    """What a worker declares when it joins."""

    worker_id: str
    total_kv_pages: int
    page_size: int
    total_gdn_slots: int
    max_batch_size: int = 0  # 0: the scheduler's default
    adapters: tuple[str, ...] = ()
    # Tokens per prefix-cache block (a multiple of page_size); 0: the worker keeps none.
    cache_block_tokens: int = 0
    # GDN state snapshots it keeps for resume points, besides total_gdn_slots.
    total_snapshot_slots: int = 0
    # Most tokens its engine runs in one step (0: no limit of its own); the budget
    # policies' token budget for it is at most this, and this when none is configured.
    max_step_tokens: int = 0
    # Prefill/decode disaggregation (docs/disaggregation.md): what it runs, and the rate
    # at which it moves a sequence's pages and states to another worker (0: unknown).
    role: WorkerRole = WorkerRole.BOTH
    transfer_bytes_per_second: float = 0.0
    # host:port of its handoff channel, for peers to fetch from ("": it cannot send).
    handoff_address: str = ""
    # What one handoff moves: attention KV bytes per token over every attention layer,
    # and the bytes of the GDN states (whatever the length); 0: unknown.
    handoff_bytes_per_token: float = 0.0
    handoff_fixed_bytes: float = 0.0


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """The settings a registered worker runs under."""

    chunk_size: int
    max_batch_size: int
    prefill_reserve_pages: int
    lease_ttl_ms: int
    # This registration's number: grows with every registration of any worker, never reused.
    incarnation: int = 0


@dataclass(frozen=True, slots=True)
class FinishedSequence:
    """A sequence that ended on a worker; `generated_tokens` counts this assignment only."""

    seq_id: int
    reason: FinishReason
    generated_tokens: int = 0
    error_message: str = ""  # why, for FAILED


@dataclass(frozen=True, slots=True)
class TokenUpdate:
    """Tokens one sequence generated since the worker's last call.

    `offset`, when set, is the index of token_ids[0] among the tokens generated since
    the sequence's admission to this worker, so a retried report adds nothing twice.
    """

    seq_id: int
    token_ids: tuple[int, ...]
    offset: int | None = None
    # One per token of token_ids when the sequence asked for logprobs, else empty.
    logprobs: tuple[TokenLogprobs, ...] = ()
    # One per prompt token after the first, with the sequence's first token, when asked.
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()


@dataclass(frozen=True, slots=True)
class TokenRuns:
    """New tokens of many sequences in parallel arrays (the wire's packed form, one
    object per report instead of one TokenUpdate per sequence): run i is
    `counts[i]` tokens (1 each when `counts` is empty) of sequence `seq_ids[i]`, taken
    in order from `token_ids`, with TokenUpdate.offset `offsets[i]` (none when
    `offsets` is empty)."""

    seq_ids: Sequence[int] = ()
    token_ids: Sequence[int] = ()
    counts: Sequence[int] = ()
    offsets: Sequence[int] = ()


@dataclass(frozen=True, slots=True)
class CacheReport:
    """A worker's prefix-cache resume points (block hashes) added and removed since its
    last call; `reset`: forget its earlier reports first (`added` then lists all)."""

    # Any sequence of ints (the server hands the message's arrays over as they are: a
    # report refused for its length is then never copied).
    added: Sequence[int] = ()
    removed: Sequence[int] = ()
    reset: bool = False


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """One worker's report at the start of an iteration (the SelectBatch request)."""

    worker_id: str
    waiting: tuple[int, ...] = ()
    running: tuple[int, ...] = ()
    kv_free_pages: int = 0
    gdn_free_slots: int = 0
    finished: tuple[FinishedSequence, ...] = ()
    preempted: tuple[int, ...] = ()
    draining: bool = False
    tokens: tuple[TokenUpdate, ...] = ()
    # More new tokens, packed (applied after `tokens`).
    token_runs: TokenRuns = TokenRuns()
    # The incarnation the worker registered as; 0: the latest (clients that do not send it).
    incarnation: int = 0
    # Prefix cache (service/core/cache/prefix_cache.py; ignored with --prefix-caching off).
    cache: CacheReport = CacheReport()
    # How many of kv_free_pages hold reusable prefix cache.
    kv_cached_pages: int = 0
    # First chunks whose resume point was gone: nothing ran, admit each again.
    cache_misses: tuple[int, ...] = ()
    # Wall time of the worker's last engine step not reported before, in microseconds
    # (0: unknown, or no step since the last report).
    last_step_us: int = 0
    # Handoffs this worker received since its last report, done or failed.
    handoffs: tuple[HandoffResult, ...] = ()
    # The iteration of the last decision the worker applied (0: none, or a client that
    # does not say): which decode may still be in flight on a prefill-only worker.
    applied_iteration: int = 0
    # A step is in flight and the worker asks for the next step's decision in another
    # report near its end: apply this one, decide nothing (docs/contract.md, "Late
    # decisions").
    decide_later: bool = False


class HandoffDirection(enum.Enum):
    """Which end of a handoff a worker is; values match the wire enum's numbers."""

    SEND = 1  # hold the sequence's pages and states for the peer until evicted
    RECEIVE = 2  # fetch them from the peer, then run the sequence


class HandoffStatus(enum.Enum):
    """How a handoff ended, as its receiver reports it; values match the wire enum's."""

    DONE = 1
    SENDER_UNREACHABLE = 2
    CHECKSUM_MISMATCH = 3
    NO_ROOM = 4
    TIMED_OUT = 5
    UNKNOWN_SEQUENCE = 6


@dataclass(frozen=True, slots=True)
class HandoffInstruction:
    """One end of a handoff (docs/contract.md, "Prefill/decode disaggregation")."""

    seq_id: int
    direction: HandoffDirection
    transfer_id: int  # unique per attempt
    peer_worker_id: str
    num_tokens: int  # tokens whose KV moves: all the sequence holds but the last
    num_generated: int  # generated before the handoff: the receiver's first offset
    deadline_ms: int
    peer_address: str = ""  # RECEIVE: the sender's handoff channel
    spec: SequenceSpec | None = None  # RECEIVE: what to run once imported
    cached_tokens: int = 0  # RECEIVE: leading tokens from the receiver's own cache


@dataclass(frozen=True, slots=True)
class HandoffResult:
    """A handoff's end, from its receiver."""

    seq_id: int
    transfer_id: int
    status: HandoffStatus
    num_bytes: int = 0
    transfer_us: int = 0
    error_message: str = ""


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """Prompt tokens [chunk_start, chunk_start + chunk_len) of a sequence.

    `spec` is set on the first chunk after an admission and None on continuations.
    """

    seq_id: int
    chunk_start: int
    chunk_len: int
    spec: SequenceSpec | None = None
    # First chunks only: prompt tokens the worker takes from its prefix cache (a resume
    # point it reported; then chunk_start == cached_tokens). 0: computed from token 0.
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Decision:
    """What one worker runs this iteration."""

    prefill: tuple[PrefillChunk, ...] = ()
    decode: tuple[int, ...] = ()
    evict: tuple[int, ...] = ()
    iteration: int = 0
    # Running sequences the scheduler took back (budget and fair, KV pages short): the
    # worker frees them before stepping; they resume later from their tokens so far.
    preempt: tuple[int, ...] = ()
    # Handoffs to start: sequences to hold for a peer (SEND) or to fetch (RECEIVE).
    handoffs: tuple[HandoffInstruction, ...] = ()


@dataclass(frozen=True, slots=True)
class SequenceInfo:
    """A read-only view of one sequence."""

    seq_id: int
    state: SequenceState
    worker_id: str
    prompt_len: int
    prefilled_tokens: int
    generated_tokens: int
    finish_reason: FinishReason | None
    queue_position: int
    error_message: str = ""  # why it failed, for FAILED
    # Prompt tokens taken from a worker's prefix cache at its latest admission (kept in
    # memory only: 0 after a restart of the scheduler).
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """A read-only view of one registered worker as of its last report."""

    worker_id: str
    num_assigned: int
    kv_free_pages: int
    gdn_free_slots: int
    total_kv_pages: int
    total_gdn_slots: int
    iteration: int
    draining: bool
    seconds_since_last_call: float
    incarnation: int = 0


@dataclass(frozen=True, slots=True)
class SchedulerStatus:
    """A read-only view of the whole scheduler."""

    queue_depth: int
    num_assigned: int
    policy: str
    workers: tuple[WorkerStatus, ...] = field(default=())
