"""A FAILED sequence's reason goes from the engine through the worker to the client, and
the worker logs it (regression, outside probe: a prompt with an out-of-vocabulary id
finished FAILED with no reason anywhere)."""

from __future__ import annotations

import logging

import pytest
import torch

from lattice.scheduler.v1 import scheduler_pb2 as pb
from tests.worker.conftest import WorkerThread, generate
from worker_client.engine.engine import ModelEngine
from worker_client.engine.loading import load_model

REASON = "token id 600 is outside the model's vocabulary of 512"


@pytest.fixture(scope="module")
def tiny_engine() -> ModelEngine:
    model = load_model("tiny", device="cpu", dtype=torch.float32, seed=0)
    return ModelEngine(model, total_kv_pages=64, page_size=16, total_gdn_slots=4, device="cpu")


def test_an_out_of_vocabulary_prompt_fails_with_its_reason_at_the_client_and_in_the_log(
    scheduler, stub, tiny_engine, caplog, capsys
):
    caplog.set_level(logging.WARNING, logger="worker_client.loop")
    from service.cli.main import main

    target = ["--target", f"127.0.0.1:{scheduler.port}"]
    worker = WorkerThread(scheduler.port, "tiny", tiny_engine).start()
    try:
        seq_id, tokens, events = generate(stub, [3, 600, 4], 5)
        info = stub.GetSequence(pb.GetSequenceRequest(seq_id=seq_id), timeout=5)
        capsys.readouterr()
        assert main(["generate", *target, "--prompt-ids", "3,600,4"]) == 0
        assert capsys.readouterr().out.splitlines()[-1] == (
            f"finished: FINISH_REASON_FAILED after 0 tokens: {REASON}"
        )
    finally:
        worker.stop.set()
        worker.join()
    assert tokens == []
    assert (events[-1].finish_reason, events[-1].error_message) == (pb.FINISH_REASON_FAILED, REASON)
    assert (info.finish_reason, info.error_message) == (pb.FINISH_REASON_FAILED, REASON)
    logged = [r for r in caplog.records if r.getMessage() == f"sequence failed: {REASON}"]
    assert [(r.seq_id, r.worker_id) for r in logged][0] == (seq_id, "tiny")

    assert main(["status", *target, str(seq_id)]) == 0
    assert capsys.readouterr().out.endswith(
        f'finish_reason=FINISH_REASON_FAILED error="{REASON}"\n'
    )
