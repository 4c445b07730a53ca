"""Unchanged running lists over a real server (docs/contract.md, "Unchanged running
lists"): the registration offers them; a steady report without its list is decoded in
full; a report naming a list the scheduler does not hold (never answered with it, or
from before a registration) gets running_needed with nothing applied."""

from __future__ import annotations

import pytest

from lattice.scheduler.v1 import scheduler_pb2 as pb

from .wire import TRANSPORTS, admitted, get_sequence, submit


@pytest.fixture(params=TRANSPORTS)
def transport(request) -> str:
    return request.param


def _report(
    worker,
    incarnation: int,
    running=(),
    since: int = 0,
    tokens=None,
) -> pb.SchedulerDecision:
    seq_ids = list(tokens or {})
    return worker.send(
        pb.SelectBatchRequest(
            worker_id=worker.worker_id,
            incarnation=incarnation,
            running=list(running),
            kv_free_pages=1000,
            gdn_free_slots=8,
            running_unchanged_since=since,
            accepts_decode_all_running=True,
            token_seq_ids=seq_ids,
            token_ids=[tokens[s][1] for s in seq_ids],
            token_offsets=[tokens[s][0] for s in seq_ids],
        )
    )


def test_a_steady_report_leaves_its_list_out_and_a_stale_one_is_asked_for_it(stub, worker):
    settings = worker.register(max_batch_size=8)
    assert settings.accepts_running_unchanged
    a, b = submit(stub, max_new_tokens=20).seq_id, submit(stub, max_new_tokens=20).seq_id
    assert sorted(admitted(_report(worker, settings.incarnation))) == [a, b]
    full = _report(worker, settings.incarnation, running=(a, b))
    assert full.decode_all_running and not full.decode
    steady = _report(
        worker, settings.incarnation, since=full.iteration, tokens={a: (0, 11), b: (0, 21)}
    )
    assert steady.decode_all_running
    # The same report again (its answer lost): the baseline still holds, nothing twice.
    again = _report(
        worker, settings.incarnation, since=full.iteration, tokens={a: (0, 11), b: (0, 21)}
    )
    assert again.decode_all_running and again.iteration == steady.iteration + 1
    assert get_sequence(stub, a).generated_tokens == 1
    stale = _report(
        worker, settings.incarnation, since=steady.iteration, tokens={a: (1, 12), b: (1, 22)}
    )
    assert stale.running_needed and not stale.decode and not stale.decode_all_running
    assert get_sequence(stub, a).generated_tokens == 1  # nothing of it applied
    # Registered again: what the earlier incarnation sent is not this one's baseline.
    settings = worker.register(max_batch_size=8)
    assert _report(worker, settings.incarnation, since=full.iteration).running_needed
