"""The core's side of principals: request_id is scoped by the
submitting principal, and a caller that does not see all meets another principal's
sequence as an unknown id. The edge (tests/security/test_principals.py) supplies them."""

from __future__ import annotations

import pytest

from service.core import SEES_ALL, Caller, NotFound, Scheduler, SequenceState
from service.core.persist.store import MemoryStore
from service.state.sqlite import SqliteStateStore

from .factories import make_config, submit, write_version_1_state_dir

ALICE, MALLORY = Caller("alice"), Caller("mallory")


def _core(store=None) -> Scheduler:
    return Scheduler(make_config(), store=store)


def test_two_principals_with_one_request_id_get_two_sequences():
    sched = _core()
    alice_seq = submit(sched, request_id="r1", principal="alice")
    mallory_seq = submit(sched, request_id="r1", principal="mallory")
    assert alice_seq != mallory_seq
    assert submit(sched, request_id="r1", principal="alice") == alice_seq
    assert submit(sched, request_id="r1", principal="mallory") == mallory_seq
    assert sched.status().queue_depth == 2


def test_another_principals_sequence_is_not_found_with_the_unknown_ids_message():
    sched = _core()
    seq_id = submit(sched, principal="alice")
    for call in (
        lambda c, s: sched.get_sequence(s, c),
        lambda c, s: sched.cancel(s, c),
        lambda c, s: sched.read_output(s, 0, c),
    ):
        with pytest.raises(NotFound) as theirs:
            call(MALLORY, seq_id)
        with pytest.raises(NotFound) as unknown:
            call(MALLORY, seq_id + 100)
        assert str(theirs.value) == str(unknown.value).replace(str(seq_id + 100), str(seq_id))
    assert sched.get_sequence(seq_id, ALICE).state is SequenceState.QUEUED
    assert sched.get_sequence(seq_id, Caller("admin", sees_all=True)).seq_id == seq_id
    assert sched.cancel(seq_id, ALICE)


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_the_principal_and_its_scoped_request_id_survive_a_restart(kind, tmp_path):
    store = MemoryStore() if kind == "memory" else SqliteStateStore(tmp_path)
    seq_id = submit(_core(store), request_id="r1", principal="alice")
    if kind == "sqlite":
        store.close()
        store = SqliteStateStore(tmp_path)
    sched = _core(store)
    with pytest.raises(NotFound):
        sched.get_sequence(seq_id, MALLORY)
    assert sched.get_sequence(seq_id, ALICE).seq_id == seq_id
    assert submit(sched, request_id="r1", principal="alice") == seq_id
    assert submit(sched, request_id="r1", principal="mallory") != seq_id


def test_sequences_of_a_state_dir_from_before_principals_are_the_anonymous_principals(tmp_path):
    write_version_1_state_dir(tmp_path, {1: 1}, request_id="old")
    sched = _core(SqliteStateStore(tmp_path))
    assert sched.get_sequence(1, Caller("")).seq_id == 1  # no tokens: as before
    assert submit(sched, request_id="old") == 1
    with pytest.raises(NotFound):
        sched.get_sequence(1, ALICE)  # tokens on: only admin sees them
    assert sched.get_sequence(1, SEES_ALL).seq_id == 1
