"""Hypothesis strategies for every Scheduler request, leaning on edge values.

Numbers come from the ends of their wire types as often as from the middle; strings are
empty, odd unicode, or long (up to ~100 KB); repeated fields are short, long (thousands
of ids) or full of duplicates; sequence ids are ones the server issued or never issued.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from lattice.scheduler.v1 import scheduler_pb2 as pb

# Reproducible runs (derandomized, no example database), no per-example deadline (the
# server is shared by the examples of a test on purpose: state builds up between them).
FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=False,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

# Strings a parser or a dict key might trip over (proto3 strings must be valid UTF-8,
# so no lone surrogates here: bytes that are not UTF-8 go through tests/fuzz/raw.py).
ODD_STRINGS = (
    "",
    " ",
    "\x00",
    "w0\x00",
    "\ufeff",
    "\u202ertl",
    "e\u0301",
    "\U0010ffff",
    "\uffff\ufffe",
    "\U0001f642" * 8,
    "w0 ",
    "W0",
    "w0\n",
    "%s%n%x",
    "' OR 1=1 --",
    "../../etc/passwd",
    "\\xff\\xfe",
    "\u0000" * 64,
    "\t\r\n",
)
# Lengths around the wire-size limits another branch adds (256 bytes), and far beyond.
LONG_LENGTHS = (255, 256, 257, 1024, 65_536, 100_000)
_EDGE_UINT32 = (0, 1, 2, 255, 256, 4095, 4096, 4097, 2**31 - 1, 2**31, UINT32_MAX - 1, UINT32_MAX)
_EDGE_UINT64 = (0, 1, 2, 2**32 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, UINT64_MAX - 1, UINT64_MAX)
_EDGE_FLOATS = (
    math.nan,
    -math.nan,
    math.inf,
    -math.inf,
    -0.0,
    0.0,
    1.0,
    -1.0,
    3.4e38,
    -3.4e38,
    1e-45,
    1e39,
)


def uint32s() -> st.SearchStrategy[int]:
    return st.one_of(st.integers(0, 8), st.sampled_from(_EDGE_UINT32), st.integers(0, UINT32_MAX))


def uint64s() -> st.SearchStrategy[int]:
    return st.one_of(st.integers(0, 8), st.sampled_from(_EDGE_UINT64), st.integers(0, UINT64_MAX))


def int32s() -> st.SearchStrategy[int]:
    return st.one_of(
        st.integers(-3, 3),
        st.sampled_from((INT32_MIN, INT32_MIN + 1, INT32_MAX)),
        st.integers(INT32_MIN, INT32_MAX),
    )


def float32s() -> st.SearchStrategy[float]:
    """Any float32, NaN and infinities included (the wire type of sampling fields)."""
    return st.one_of(st.sampled_from(_EDGE_FLOATS), st.floats(width=32))


def texts() -> st.SearchStrategy[str]:
    """Short random unicode, odd strings, or one character repeated up to 100,000 times."""
    return st.one_of(
        st.text(st.characters(blacklist_categories=("Cs",)), max_size=12),
        st.sampled_from(ODD_STRINGS),
        st.builds(
            lambda char, length: char * length,
            st.sampled_from(("a", "\u00e9", "\U0001f642", "\x00")),
            st.sampled_from(LONG_LENGTHS),
        ),
    )


def id_lists(ids: st.SearchStrategy[int]) -> st.SearchStrategy[list[int]]:
    """None, a few ids, thousands of distinct ids, or one id repeated thousands of times."""
    return st.one_of(
        st.just([]),
        st.lists(ids, max_size=6),
        st.builds(
            lambda start, count: list(range(start, start + count)),
            st.integers(0, 2**40),
            st.sampled_from((1_000, 5_000)),
        ),
        st.builds(lambda one, count: [one] * count, ids, st.sampled_from((2, 3, 2_000))),
    )


def token_lists() -> st.SearchStrategy[list[int]]:
    return st.one_of(
        st.lists(uint32s(), max_size=8),
        st.builds(
            lambda token, count: [token] * count,
            uint32s(),
            st.sampled_from((4_095, 4_096, 5_000, 100_000)),
        ),
    )


def sampling() -> st.SearchStrategy[pb.SamplingParams]:
    return st.builds(
        pb.SamplingParams, temperature=float32s(), top_p=float32s(), top_k=uint32s(), seed=uint64s()
    )


def submit_requests() -> st.SearchStrategy[pb.SubmitRequest]:
    # Mostly small prompts and budgets, so many of them are accepted and the server's
    # state grows; the rest are edge values.
    small_tokens = st.lists(st.integers(0, 50_000), min_size=1, max_size=6)
    return st.builds(
        pb.SubmitRequest,
        request_id=st.one_of(st.just(""), st.sampled_from(("r1", "r2")), texts()),
        prompt_token_ids=st.one_of(small_tokens, token_lists()),
        max_new_tokens=st.one_of(st.integers(1, 16), uint32s()),
        adapter_id=st.one_of(st.just(""), texts()),
        priority=int32s(),
        tenant=texts(),
        sampling=st.one_of(st.none(), sampling()),
        stop_token_ids=token_lists(),
    )


def seq_ids(known: Callable[[], list[int]]) -> st.SearchStrategy[int]:
    """An id the server issued, read from `known()` when drawn, or one it never issued.

    The choice is drawn as an index, so what hypothesis draws has the same shape
    whatever the server's state (a strategy built from the live list would not).
    """

    def pick(index: int) -> int:
        ids = known()
        return ids[index % len(ids)] if ids else index

    return st.one_of(st.integers(0, 63).map(pick), uint64s())


def worker_ids() -> st.SearchStrategy[str]:
    """Mostly one of a few names (so workers register, then report), sometimes anything."""
    return st.one_of(st.sampled_from(("w0", "w1")), texts())


def register_requests() -> st.SearchStrategy[pb.RegisterWorkerRequest]:
    return st.builds(
        pb.RegisterWorkerRequest,
        worker_id=worker_ids(),
        total_kv_pages=uint32s(),
        page_size=st.one_of(st.just(16), uint32s()),
        total_gdn_slots=uint32s(),
        max_batch_size=st.one_of(st.integers(0, 8), uint32s()),
        adapters=st.one_of(
            st.lists(texts(), max_size=4),
            st.builds(lambda a, n: [a] * n, st.sampled_from(ODD_STRINGS), st.just(1_000)),
        ),
    )


def select_batch_requests(
    known: Callable[[], list[int]],
) -> st.SearchStrategy[pb.SelectBatchRequest]:
    """Reports a worker could send (some with edge values), or anything at all."""
    return st.one_of(_plausible_reports(seq_ids(known)), _wild_reports(seq_ids(known)))


@st.composite
def _plausible_reports(draw, ids: st.SearchStrategy[int]) -> pb.SelectBatchRequest:
    """w0 or w1 reporting disjoint waiting/running/finished/preempted ids, valid reasons.

    Every draw has the same shape whatever the ids turn out to be (ids come from the live
    server, so a draw shaped by them would make hypothesis' replays inconsistent).
    """
    unique = list(dict.fromkeys(draw(st.lists(ids, max_size=8))))
    a, b, c = sorted(min(draw(st.integers(0, 8)), len(unique)) for _ in range(3))
    running = unique[a:b]
    picks = draw(st.lists(st.integers(0, 7), max_size=3))
    return pb.SelectBatchRequest(
        worker_id=draw(st.sampled_from(("w0", "w1"))),
        waiting=unique[:a],
        running=running,
        preempted=unique[c:],
        finished=[
            pb.FinishedSequence(
                seq_id=s,
                reason=draw(st.integers(1, 6)),
                generated_tokens=draw(st.one_of(st.integers(0, 8), uint32s())),
            )
            for s in unique[b:c]
        ],
        tokens=_token_updates(draw, running, picks),
        kv_free_pages=draw(st.one_of(st.just(1_000), uint32s())),
        gdn_free_slots=draw(st.one_of(st.just(64), uint32s())),
        draining=draw(st.booleans()),
        idle_wait_ms=draw(idle_waits()),
    )


def idle_waits() -> st.SearchStrategy[int]:
    """Long polls short enough that a parked call ends well within RPC_TIMEOUT_SECONDS."""
    return st.one_of(st.just(0), st.integers(1, 50))


def _token_updates(draw, running: list[int], picks: list[int]) -> list[pb.TokenUpdate]:
    updates = []
    for i in picks:  # drawn whether or not anything runs: the same shape either way
        token_ids = draw(st.lists(uint32s(), max_size=3))
        offset = draw(st.one_of(st.none(), st.integers(0, 4), uint32s()))
        if running:
            updates.append(
                pb.TokenUpdate(seq_id=running[i % len(running)], token_ids=token_ids, offset=offset)
            )
    return updates


def _wild_reports(ids: st.SearchStrategy[int]) -> st.SearchStrategy[pb.SelectBatchRequest]:
    finished = st.builds(
        pb.FinishedSequence,
        seq_id=ids,
        reason=st.one_of(st.integers(1, 6), st.integers(0, 7), int32s()),
        generated_tokens=uint32s(),
    )
    tokens = st.builds(
        pb.TokenUpdate, seq_id=ids, token_ids=token_lists(), offset=st.one_of(st.none(), uint32s())
    )
    return st.builds(
        pb.SelectBatchRequest,
        worker_id=worker_ids(),
        waiting=id_lists(ids),
        running=id_lists(ids),
        kv_free_pages=st.one_of(st.just(1_000), uint32s()),
        gdn_free_slots=st.one_of(st.just(64), uint32s()),
        finished=st.lists(finished, max_size=3),
        preempted=st.one_of(st.just([]), id_lists(ids)),
        draining=st.booleans(),
        tokens=st.lists(tokens, max_size=3),
        idle_wait_ms=idle_waits(),
    )


def requests_for(method: str, known: Callable[[], list[int]]) -> st.SearchStrategy:
    """A random request message for `method` (a Scheduler RPC name)."""
    if method in ("Submit", "Generate"):
        return submit_requests()
    if method == "Cancel":
        return st.builds(pb.CancelRequest, seq_id=seq_ids(known))
    if method == "GetSequence":
        return st.builds(pb.GetSequenceRequest, seq_id=seq_ids(known))
    if method == "FollowSequence":
        return st.builds(pb.FollowSequenceRequest, seq_id=seq_ids(known), start=uint32s())
    if method == "RegisterWorker":
        return register_requests()
    if method in ("SelectBatch", "WorkerSession"):
        return select_batch_requests(known)
    if method == "DeregisterWorker":
        return st.builds(pb.DeregisterWorkerRequest, worker_id=worker_ids())
    if method == "GetStatus":
        return st.just(pb.GetStatusRequest())
    if method == "DrainWorker":
        return st.builds(pb.DrainWorkerRequest, worker_id=worker_ids(), resume=st.booleans())
    raise ValueError(f"no strategy for Scheduler/{method}")
