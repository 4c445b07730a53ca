"""The servicer's upkeep of unchanged running lists (docs/contract.md, "Unchanged
running lists"): a lease that expired during another worker's call leaves no baseline
behind after the next sweep, and a report answered with running_needed is timed in
SelectBatch's latency histogram like every other."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from lattice.scheduler.v1 import scheduler_pb2 as pb
from service.server.metrics import SchedulerMetrics
from service.server.servicer import SchedulerServicer
from service.server.wakeups import Wakeups
from tests.unit.factories import FakeClock, make_scheduler

DURATION_COUNT = "lattice_scheduler_select_batch_duration_seconds_count"


async def _register(servicer, worker_id: str) -> pb.RegisterWorkerResponse:
    return await servicer.RegisterWorker(
        pb.RegisterWorkerRequest(
            worker_id=worker_id,
            total_kv_pages=100,
            page_size=16,
            total_gdn_slots=8,
            max_batch_size=8,
        ),
        None,
    )


def test_a_lease_expired_during_another_workers_call_leaves_no_running_list():
    async def main():
        clock = FakeClock()
        core = make_scheduler(clock, lease_ttl_ms=1000)
        servicer = SchedulerServicer(core, Wakeups())
        settings = await _register(servicer, "w0")
        await servicer.SelectBatch(
            pb.SelectBatchRequest(
                worker_id="w0",
                incarnation=settings.incarnation,
                running=[],
                kv_free_pages=100,
                gdn_free_slots=8,
                accepts_decode_all_running=True,
            ),
            None,
        )
        assert "w0" in servicer._running_lists
        clock.advance_ms(600)
        await _register(servicer, "w1")
        clock.advance_ms(600)  # w0 is past its lease, w1 is not
        await servicer.SelectBatch(
            pb.SelectBatchRequest(worker_id="w1", kv_free_pages=100, gdn_free_slots=8), None
        )
        assert core.worker_ids() == {"w1"}  # w0 expired during w1's call
        assert servicer.expire_leases() == []  # nothing left for the sweep to expire...
        assert "w0" not in servicer._running_lists  # ...but its baseline went with it
        assert "w1" in servicer._running_lists

    asyncio.run(main())


def test_a_running_needed_answer_is_timed_like_every_select_batch():
    async def main():
        registry = CollectorRegistry()
        servicer = SchedulerServicer(
            make_scheduler(), Wakeups(), metrics=SchedulerMetrics(registry)
        )
        settings = await _register(servicer, "w0")
        answer = await servicer.SelectBatch(
            pb.SelectBatchRequest(
                worker_id="w0",
                incarnation=settings.incarnation,
                kv_free_pages=100,
                gdn_free_slots=8,
                running_unchanged_since=7,
                accepts_decode_all_running=True,
            ),
            None,
        )
        assert answer.running_needed
        assert registry.get_sample_value(DURATION_COUNT) == 1

    asyncio.run(main())
