"""The worker sends its tokens in the packed arrays only to a scheduler that said at
registration it takes them (`accepts_token_runs`); to any other, as TokenUpdate messages,
so that an older scheduler loses no token."""

from __future__ import annotations

import threading

import pytest

from lattice.scheduler.v1 import scheduler_pb2 as pb
from tests.worker.scripted_client import ScriptedClient
from worker_client.client import WorkerResources
from worker_client.convert import PendingReport
from worker_client.loop import WorkerLoop
from worker_client.testing import ScriptedEngine, reference_output

PROMPT = [3, 1, 4, 1, 5]


def _report(pending: PendingReport) -> pb.SelectBatchRequest:
    return pending.request(
        "w0", waiting=[], running=[1, 2], kv_free_pages=10, gdn_free_slots=2, draining=False
    )


def test_without_the_schedulers_word_every_token_goes_as_a_token_update():
    pending = PendingReport()
    pending.tokens.update({1: [7], 2: [8, 9]})
    request = _report(pending)
    assert [(t.seq_id, list(t.token_ids), t.offset) for t in request.tokens] == [
        (1, [7], 0),
        (2, [8, 9], 0),
    ]
    assert not request.token_seq_ids and not request.token_ids


def test_with_it_tokens_are_packed_and_logprob_carrying_ones_stay_token_updates():
    pending = PendingReport()
    pending.packed_tokens = True
    pending.tokens.update({1: [7], 2: [8, 9], 3: [4]})
    pending.logprobs[3] = [pb.TokenLogprobs(logprob=-0.5)]
    request = _report(pending)
    assert list(request.token_seq_ids) == [1, 2]
    assert list(request.token_ids) == [7, 8, 9]
    assert list(request.token_counts) == [1, 2]
    assert list(request.token_offsets) == [0, 0]
    assert [(t.seq_id, list(t.token_ids), len(t.logprobs)) for t in request.tokens] == [(3, [4], 1)]


class _Registering(ScriptedClient):
    def __init__(self, decisions, stop, accepts_token_runs: bool) -> None:
        super().__init__(decisions, stop)
        self._accepts = accepts_token_runs

    def register(self, resources: WorkerResources) -> pb.RegisterWorkerResponse:
        response = super().register(resources)
        response.accepts_token_runs = self._accepts
        return response


@pytest.mark.parametrize("accepts", [False, True])
def test_the_loop_sends_the_form_its_registration_allows(accepts):
    spec = pb.SequenceSpec(prompt_token_ids=PROMPT, max_new_tokens=3)
    decisions = [
        pb.SchedulerDecision(
            prefill=[pb.PrefillChunk(seq_id=1, chunk_start=0, chunk_len=5, spec=spec)]
        ),
        pb.SchedulerDecision(decode=[1]),
        pb.SchedulerDecision(decode=[1]),
    ]
    engine, stop = ScriptedEngine(), threading.Event()
    client = _Registering(decisions, stop, accepts)
    resources = WorkerResources(
        "w0", engine.total_kv_pages, engine.page_size, engine.total_gdn_slots
    )
    WorkerLoop(engine, client, resources, idle_sleep_seconds=0.001).run(stop)
    packed = [t for r in client.requests for t in r.token_ids]
    unpacked = [t for r in client.requests for u in r.tokens for t in u.token_ids]
    expected = reference_output(PROMPT, 3)
    assert (packed, unpacked) == ((expected, []) if accepts else ([], expected))
