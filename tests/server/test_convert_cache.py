"""The server parses the prefix-cache fields of registrations and reports."""

import pytest

from lattice.scheduler.v1 import scheduler_pb2 as pb
from service.core import InvalidArgument
from service.core.types import CacheReport
from service.server import convert


def test_a_registration_carries_the_cache_block_and_snapshot_slots():
    reg = convert.worker_registration(
        pb.RegisterWorkerRequest(
            worker_id="w",
            total_kv_pages=10,
            page_size=16,
            total_gdn_slots=2,
            cache_block_tokens=64,
            total_snapshot_slots=12,
        )
    )
    assert (reg.cache_block_tokens, reg.total_snapshot_slots) == (64, 12)


def test_a_registration_without_a_cache_reads_as_before():
    reg = convert.worker_registration(
        pb.RegisterWorkerRequest(worker_id="w", total_kv_pages=10, page_size=16, total_gdn_slots=2)
    )
    assert (reg.cache_block_tokens, reg.total_snapshot_slots) == (0, 0)


def test_a_cache_block_off_the_page_grid_is_refused_naming_the_field():
    with pytest.raises(
        InvalidArgument, match=r"cache_block_tokens must be a multiple of page_size \(16\), got 24"
    ):
        convert.worker_registration(
            pb.RegisterWorkerRequest(
                worker_id="w",
                total_kv_pages=10,
                page_size=16,
                total_gdn_slots=2,
                cache_block_tokens=24,
            )
        )


def test_a_report_carries_its_cache_delta_cached_pages_and_misses():
    msg = pb.SelectBatchRequest(
        worker_id="w", kv_free_pages=9, kv_cached_pages=4, cache_misses=[7, 8]
    )
    msg.cache.added.extend([2**64 - 1, 5])
    msg.cache.removed.append(3)
    msg.cache.reset = True
    report = convert.worker_report(msg)
    cache = report.cache
    assert (tuple(cache.added), tuple(cache.removed), cache.reset) == ((2**64 - 1, 5), (3,), True)
    assert report.kv_cached_pages == 4 and report.cache_misses == (7, 8)
    assert convert.worker_report(pb.SelectBatchRequest(worker_id="w")).cache == CacheReport()


def test_a_report_in_the_packed_token_form_reads_as_token_runs():
    """The packed arrays arrive as one TokenRuns; the old form still reads as
    TokenUpdates, and a report without tokens carries neither."""
    packed = convert.worker_report(
        pb.SelectBatchRequest(
            worker_id="w",
            running=[3, 4],
            token_seq_ids=[3, 4],
            token_ids=[11, 12, 21],
            token_counts=[2, 1],
            token_offsets=[0, 5],
        )
    )
    assert packed.tokens == ()
    runs = packed.token_runs
    assert (list(runs.seq_ids), list(runs.token_ids), list(runs.counts), list(runs.offsets)) == (
        [3, 4],
        [11, 12, 21],
        [2, 1],
        [0, 5],
    )
    old = convert.worker_report(
        pb.SelectBatchRequest(
            worker_id="w", running=[3], tokens=[pb.TokenUpdate(seq_id=3, token_ids=[11], offset=0)]
        )
    )
    assert [(t.seq_id, t.token_ids, t.offset) for t in old.tokens] == [(3, (11,), 0)]
    assert not old.token_runs.seq_ids and not old.token_runs.token_ids
