"""A queued sequence whose adapter no worker that takes work has says why it waits,
and a replica's core tells which of its queued sequences its
workers cannot run and which adapters a claim may take."""

from __future__ import annotations

from service.core import ReplicaScheduler, Scheduler

from .factories import make_config, register, submit


def test_get_sequence_says_no_worker_has_the_adapter_until_one_registers_with_it():
    sched = Scheduler(make_config())
    register(sched, "plain")
    seq_id = submit(sched, adapter_id="lora-x")
    plain_seq = submit(sched)
    info = sched.get_sequence(seq_id)
    assert "lora-x" in info.error_message and "no live worker" in info.error_message
    assert sched.get_sequence(plain_seq).error_message == ""
    assert sched.num_unservable_queued() == 1
    register(sched, "lora", adapters=("lora-x",))
    assert sched.get_sequence(seq_id).error_message == ""
    assert sched.num_unservable_queued() == 0
    sched.drain_worker("lora", resume=False)  # drained: it takes no new work
    assert "lora-x" in sched.get_sequence(seq_id).error_message
    assert sched.num_unservable_queued() == 1
    sched.cancel(seq_id)
    assert sched.num_unservable_queued() == 0


def test_a_replica_core_names_the_queued_sequences_its_workers_cannot_run():
    core = ReplicaScheduler(make_config())
    register(core, "plain")
    register(core, "lora", adapters=("lora-x", "lora-y"))
    assert core.servable_adapters() == {"lora-x", "lora-y"}
    wanted, stranded = submit(core, adapter_id="lora-x"), submit(core, adapter_id="lora-z")
    submit(core)
    assert core.unservable_queued() == [stranded]
    core.deregister_worker("lora")
    assert core.servable_adapters() == frozenset()
    assert sorted(core.unservable_queued()) == [wanted, stranded]
