"""A worker loop whose worker_id another loop registered since stops with Superseded and
never registers again; the newer one serves every sequence to its reference output."""

from __future__ import annotations

import threading

import pytest

from common.waiting import wait_until
from tests.worker.conftest import WorkerThread, generate
from worker_client.client import Superseded
from worker_client.testing import ScriptedEngine, reference_output


@pytest.mark.parametrize("scheduler", [{"chunk_size": 16, "max_seq_len": 256}], indirect=True)
def test_the_older_of_two_loops_with_one_worker_id_stops_and_the_newer_serves(scheduler, stub):
    first = WorkerThread(
        scheduler.port, "twin", ScriptedEngine(total_gdn_slots=4, step_seconds=0.002)
    ).start()
    prompts = [[i + 1, i + 2, i + 3] for i in range(30)]
    results: dict[int, list[int]] = {}

    def one(index: int) -> None:
        results[index] = generate(stub, prompts[index], 20, timeout=60)[1]

    streams = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in streams:
        t.start()
    wait_until(
        lambda: first.loop.stats.generated_tokens >= 10,
        "ten tokens generated",
        10,
        every_seconds=0.005,
    )
    second = WorkerThread(scheduler.port, "twin", ScriptedEngine(total_gdn_slots=4)).start()
    with pytest.raises(Superseded, match="superseded: worker_id 'twin'"):
        first.join()
    for t in streams:
        t.join(60)
    second.stop.set()
    second.join()
    assert first.loop.stats.registrations == 1, "a superseded loop must not register again"
    assert first.client.incarnation < second.client.incarnation
    for i, prompt in enumerate(prompts):
        assert results[i] == reference_output(prompt, 20), f"stream {i}"
