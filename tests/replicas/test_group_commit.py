"""Group commit on PostgreSQL (service/state/pg_commit.py), prefix homes
(service/core/persist/homes.py) and the save batch they rest on, against a real private
cluster where a database is needed."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import psycopg
import pytest

from lattice.scheduler.v1 import scheduler_pb2 as pb
from service.core.persist.homes import HOME_BLOCK_TOKENS, finished_key, prompt_keys
from service.core.persist.store import SequenceProgress, StateChanges, StoreError, TokenAppend
from service.core.types import FinishReason, SequenceState
from service.replicas import servicer as replica_servicer
from service.server.wakeups import Wakeups
from service.state.pg_batch import SaveBatch
from service.state.pg_commit import ReplicaCommits
from tests.unit.factories import finished, params, register, report

from .test_state_postgres import Replica, replicas  # noqa: F401 - the fixture


def _progress(seq_id: int, state=SequenceState.DECODING, worker="w") -> SequenceProgress:
    return SequenceProgress(seq_id, state, worker, None, 0, 0, 0, 0, None)


def test_a_batch_keeps_the_latest_progress_and_every_append_in_order():
    batch = SaveBatch()
    batch.absorb(StateChanges(progress=(_progress(1),), tokens=(TokenAppend(1, 0, (5,)),)))
    batch.absorb(
        StateChanges(
            progress=(_progress(1, SequenceState.FINISHED),),
            tokens=(TokenAppend(1, 1, (6,)), TokenAppend(2, 0, (7,))),
            final_outputs=((1, (5, 6)),),
            sync=True,
        )
    )
    assert batch.progress[1].state is SequenceState.FINISHED
    assert [(t.seq_id, t.start) for t in batch.tokens] == [(1, 0), (1, 1), (2, 0)]
    assert (batch.num_saves, batch.sync, batch.touched()) == (2, True, {1, 2})
    assert batch.without({1}).touched() == {2}
    assert batch.without({1}).final_outputs == {}


def test_a_failed_batch_goes_back_ahead_of_later_saves():
    failed, later = SaveBatch(), SaveBatch()
    failed.absorb(StateChanges(tokens=(TokenAppend(1, 0, (5,)),), progress=(_progress(1),)))
    later.absorb(
        StateChanges(
            tokens=(TokenAppend(1, 1, (6,)),), progress=(_progress(1, SequenceState.FINISHED),)
        )
    )
    merged = failed.then(later)
    assert [t.start for t in merged.tokens] == [0, 1]
    assert merged.progress[1].state is SequenceState.FINISHED
    assert merged.num_saves == 2


def test_a_finished_text_is_found_again_among_the_prefixes_of_its_next_turn():
    prompt, output = list(range(1, 40)), [9] * 20
    key = finished_key(prompt, output)
    assert key in prompt_keys([*prompt, *output, 3, 4, 5])
    assert key not in prompt_keys([*prompt, 8, *output])
    assert finished_key([1] * (HOME_BLOCK_TOKENS - 1), []) is None
    assert prompt_keys([1] * (HOME_BLOCK_TOKENS - 1)) == []


def test_saves_of_several_calls_commit_together_and_only_then_count_as_committed(replicas):
    a, b = replicas("a"), replicas("b")
    ids = [b.submit(max_new_tokens=8) for _ in range(3)]
    register(a.core, "w", max_batch_size=3)
    a.claim()

    async def scenario() -> tuple[int, int]:
        commits = ReplicaCommits(a.state, on_disowned=lambda seq_ids: None)
        a.core.select_batch(report("w"))  # admits all three
        a.core.select_batch(report("w", running=tuple(ids), tokens={i: (4,) for i in ids}))
        # Collected, not committed: another replica sees nothing yet.
        assert b.state.read_output(ids[0], 0).token_ids == ()
        before = a.state.num_commits
        await asyncio.gather(commits.committed(), commits.committed())
        await commits.close()
        return a.state.num_commits - before, a.state.num_saves_committed

    num_commits, num_saves = asyncio.run(scenario())
    assert num_commits == 1 and num_saves >= 2
    assert [b.state.read_output(i, 0).token_ids for i in ids] == [(4,), (4,), (4,)]


def test_a_group_commit_leaves_out_what_another_replica_took_and_commits_the_rest(
    replicas,
    database_url,
):
    a, b = replicas("a"), replicas("b")
    kept, taken = b.submit(max_new_tokens=8), b.submit(max_new_tokens=8)
    register(a.core, "w", max_batch_size=2)
    a.claim()
    disowned: list[frozenset[int]] = []

    async def scenario() -> None:
        commits = ReplicaCommits(a.state, on_disowned=disowned.append)
        a.core.select_batch(report("w"))
        await commits.committed()
        # Another replica takes one over (as a worker moving there would).
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(
                "UPDATE replicas SET fence = nextval('lattice_fences') WHERE replica_id = %s",
                (a.state.replica_id,),
            )
            conn.execute(
                "UPDATE sequences SET owner = %s WHERE seq_id = %s", (b.state.replica_id, taken)
            )
        a.core.select_batch(report("w", running=(kept, taken), tokens={kept: (1,), taken: (2,)}))
        await commits.committed()
        await commits.close()

    asyncio.run(scenario())
    assert disowned == [frozenset({taken})]
    assert b.state.read_output(kept, 0).token_ids == (1,)
    assert b.state.read_output(taken, 0).token_ids == ()


def test_calls_saving_while_the_replica_row_is_gone_fail_until_its_lease_is_renewed(
    replicas, database_url
):
    a, b = replicas("a"), replicas("b")
    seq_id = b.submit(max_new_tokens=8)
    register(a.core, "w", max_batch_size=1)
    a.claim()
    disowned: list[frozenset[int]] = []

    async def scenario() -> None:
        commits = ReplicaCommits(a.state, on_disowned=disowned.append)
        a.core.select_batch(report("w"))
        a.core.select_batch(report("w", running=(seq_id,), tokens={seq_id: (4,)}))
        await commits.committed()  # acknowledged
        with psycopg.connect(database_url, autocommit=True) as conn:  # a's lease runs out
            conn.execute(
                "UPDATE replicas SET lease_until = now() - interval '1 second' "
                "WHERE replica_id = %s",
                (a.state.replica_id,),
            )
        b.state.reclaim_expired()  # deletes a's row, takes the sequence back
        a.core.select_batch(report("w", running=(seq_id,), tokens={seq_id: (5,)}))
        with pytest.raises(StoreError, match="no row"):  # UNAVAILABLE to the caller
            await commits.committed()
        assert not a.state.renew_lease()  # the keeper writes the row again
        await commits.committed()  # the retry: the sequence is another's now
        await commits.close()

    asyncio.run(scenario())
    assert disowned == [frozenset({seq_id})]
    assert b.state.read_output(seq_id, 0).token_ids == (4,)  # what was acknowledged


@pytest.mark.parametrize("via", ["stream", "GetSequence"])
def test_a_reader_is_not_given_tokens_their_commit_left_out(
    replicas, database_url, monkeypatch, via
):
    a, b = replicas("a"), replicas("b")
    seq_id = b.submit(max_new_tokens=8)
    register(a.core, "w")
    a.claim()
    monkeypatch.setattr(replica_servicer, "_REMOTE_POLL_SECONDS", 0.05)

    async def scenario():
        servicer = replica_servicer.ReplicaServicer(a.core, Wakeups(), a.state)
        a.core.select_batch(report("w"))
        await servicer._commits.committed()
        a.core.select_batch(report("w", running=(seq_id,), tokens={seq_id: (1,)}))
        assert (await servicer._read(seq_id, 0))[0].token_ids == (1,)
        # Another replica takes it over; tokens generated here meanwhile are not committed.
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(
                "UPDATE replicas SET fence = nextval('lattice_fences') WHERE replica_id = %s",
                (a.state.replica_id,),
            )
            conn.execute(
                "UPDATE sequences SET owner = %s WHERE seq_id = %s", (b.state.replica_id, seq_id)
            )
        a.core.select_batch(report("w", running=(seq_id,), tokens={seq_id: (2,)}))
        # The commit the read waits for leaves the (2,) out.
        if via == "GetSequence":
            info = await servicer.GetSequence(pb.GetSequenceRequest(seq_id=seq_id), None)
            read = info.generated_tokens
        else:
            read = len((await servicer._read(seq_id, 0))[0].token_ids)
        await servicer._commits.close()
        return read

    assert asyncio.run(scenario()) == 1  # only the committed (1,)
    assert b.state.read_output(seq_id, 0).token_ids == (1,)


def test_a_sequence_given_up_leaves_no_prompt_behind(replicas, database_url):
    a, b = replicas("a"), replicas("b")
    a.state._affinity_seconds = 60.0  # homes on: claims remember prompts
    seq_id = b.submit(max_new_tokens=8)
    register(a.core, "w")
    a.claim()
    assert seq_id in a.state._prompts
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE sequences SET owner = %s WHERE seq_id = %s", (b.state.replica_id, seq_id)
        )

    async def scenario() -> None:
        servicer = replica_servicer.ReplicaServicer(a.core, Wakeups(), a.state)
        await servicer._give_up(None)  # the keeper's reconciliation
        await servicer._commits.close()

    asyncio.run(scenario())
    assert seq_id not in a.core.owned_seq_ids()
    assert seq_id not in a.state._prompts


def test_a_follow_up_is_left_to_the_replica_where_its_conversation_finished(replicas):
    a = replicas("a")
    b = Replica(a.state.url, "b")
    b.state._affinity_seconds = 60.0
    a.state._affinity_seconds = 60.0
    try:
        prompt = tuple(range(2, 2 + 2 * HOME_BLOCK_TOKENS))
        first = a.state.submit(
            replace(params(max_new_tokens=2), prompt_token_ids=prompt), 1000, 0
        ).seq_id
        register(a.core, "w")
        a.claim()
        a.core.select_batch(report("w"))
        a.core.select_batch(
            report(
                "w", tokens={first: (7, 8)}, finished=(finished(first, FinishReason.MAX_LENGTH, 2),)
            )
        )
        follow_up = prompt + (7, 8) + tuple(range(100, 100 + HOME_BLOCK_TOKENS))
        second = b.state.submit(replace(params(), prompt_token_ids=follow_up), 1000, 0).seq_id
        other = b.state.submit(replace(params(), prompt_token_ids=(5, 6, 7)), 1000, 0).seq_id
        register(b.core, "v")
        assert b.claim() == [other]  # the follow-up waits for a, its home
        assert a.claim() == [second]
    finally:
        b.state.close()


def test_token_log_rows_are_read_on_from_a_stream_s_place_and_collected_once_forgotten(
    replicas,
    database_url,
):
    a, b = replicas("a"), replicas("b")
    seq_id = b.submit(max_new_tokens=8)
    register(a.core, "w")
    a.claim()
    a.core.select_batch(report("w"))
    a.core.select_batch(report("w", running=(seq_id,), tokens={seq_id: (7, 8)}))
    assert b.state.read_output(seq_id, 0).token_ids == (7, 8)
    a.core.select_batch(report("w", running=(seq_id,), tokens={seq_id: (9,)}))
    assert b.state.read_output(seq_id, 2).token_ids == (9,)  # from its place on
    assert b.state.read_output(seq_id, 1).token_ids == (8, 9)
    assert b.state.sequence_info(seq_id).generated_tokens == 3
    assert a.state.collect_token_log() == 0  # its sequence is still there
    a.state.save(StateChanges(forgotten=(seq_id,)))
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM token_log").fetchone() == (2,)
        assert a.state.collect_token_log() == 2
        assert a.state.collect_token_log() == 0
        assert conn.execute("SELECT count(*) FROM token_log").fetchone() == (0,)


def test_sequences_handed_back_are_claimed_in_line_before_their_notification(replicas):
    """A replica hands its queue back while its only worker drains; the worker's next
    report, before the release's NOTIFY reaches the listener (here: never, none runs),
    still claims them back and admits them."""
    a, b = replicas("a"), replicas("b")
    seq_ids = [b.submit(max_new_tokens=8) for _ in range(3)]
    register(a.core, "w", max_batch_size=2)

    async def scenario() -> list[int]:
        servicer = replica_servicer.ReplicaServicer(a.core, Wakeups(), a.state)
        await servicer._top_up(only_if_short=False)  # all 3: the claim came back short
        first = a.core.select_batch(report("w"))
        assert [s.seq_id for s in first.prefill] == seq_ids[:2]
        a.core.select_batch(report("w", draining=True))  # both lost: queued again
        await servicer._commits.committed()
        await servicer._hand_back_excess()  # a draining worker needs no queue here
        assert a.core.num_queued() == 0
        answer = await servicer._select(
            pb.SelectBatchRequest(
                worker_id="w", kv_free_pages=100, gdn_free_slots=100, running_unchanged_since=0
            )
        )
        await servicer._commits.close()
        return [c.seq_id for c in answer.prefill if c.HasField("spec")]

    assert asyncio.run(scenario()) == seq_ids[:2]


class _CountingStore:
    """Stands in for PostgresState under ReplicaCommits: saves counted, each commit's
    number of saves recorded."""

    def __init__(self) -> None:
        self.num_saves = 0
        self.commits: list[int] = []
        self._committed = 0

    def defer_saves(self) -> None:
        pass

    def save(self) -> None:
        self.num_saves += 1

    def commit_pending(self) -> frozenset[int]:
        self.commits.append(self.num_saves - self._committed)
        self._committed = self.num_saves
        return frozenset()


async def _saves_of_calls(commits: ReplicaCommits, store: _CountingStore, calls: int) -> None:
    """`calls` calls, each saving then waiting for its commit, one after another on the
    loop (as SelectBatch handlers run): the first save's commit starts gathering."""

    async def call() -> None:
        store.save()
        await commits.committed()

    waiting = []
    for _ in range(calls):
        waiting.append(asyncio.ensure_future(call()))
        await asyncio.sleep(0)  # the call runs up to its wait
    # A safety limit only: a commit that waited for its whole max_wait_seconds (an hour)
    # would hold the test this long.
    await asyncio.wait_for(asyncio.gather(*waiting), 60)


def _commits_of_rounds(rounds: list[int], expected: int, max_wait_seconds: float) -> list[int]:
    """The saves each commit held, for rounds of calls (`rounds[i]` calls in round i, one
    round after the other) on ReplicaCommits expecting `expected` saves a commit."""
    store = _CountingStore()

    async def scenario() -> None:
        commits = ReplicaCommits(
            store,
            on_disowned=lambda ids: None,
            max_wait_seconds=max_wait_seconds,
            expected_saves=lambda: expected,
        )
        for calls in rounds:
            await _saves_of_calls(commits, store, calls)
        await commits.close()

    asyncio.run(scenario())
    return store.commits


def test_a_waiting_commit_starts_once_every_worker_has_saved_not_at_its_limit():
    # One commit for each round of the three workers.
    assert _commits_of_rounds([3, 3], expected=3, max_wait_seconds=3600) == [3, 3]


def test_a_replica_with_one_worker_commits_its_save_without_waiting():
    assert _commits_of_rounds([1, 1, 1], expected=1, max_wait_seconds=3600) == [1, 1, 1]


def test_a_waiting_commit_that_too_few_saves_reach_starts_at_its_limit():
    assert _commits_of_rounds([2], expected=4, max_wait_seconds=0.01) == [2]


def test_a_commit_asked_for_promptly_starts_without_waiting_for_more_saves():
    """A call that holds what others wait for (the claim lock) asks for its commit
    promptly: the commit gathering for four saves starts with the three it has."""
    store = _CountingStore()

    async def scenario() -> None:
        commits = ReplicaCommits(
            store, on_disowned=lambda ids: None, max_wait_seconds=3600, expected_saves=lambda: 4
        )
        waiting = []
        for promptly in (False, False, True):
            store.save()
            waiting.append(asyncio.ensure_future(commits.committed(promptly=promptly)))
            await asyncio.sleep(0)
        # A safety limit only: without `promptly` the commit waits an hour.
        await asyncio.wait_for(asyncio.gather(*waiting), 10)
        # The next commit waits again for every worker's save.
        await _saves_of_calls(commits, store, 4)
        await commits.close()

    asyncio.run(scenario())
    assert store.commits == [3, 4]


def _two_workers_on_a(replicas, batch: int) -> tuple[Replica, Replica, list[int]]:
    """Replicas a and b; workers w1 and w2 of `batch` places each registered on a, which
    has claimed the 2 x `batch` sequences submitted on b (their ids)."""
    a, b = replicas("a"), replicas("b")
    ids = [b.submit(max_new_tokens=8) for _ in range(2 * batch)]
    register(a.core, "w1", max_batch_size=batch)
    register(a.core, "w2", max_batch_size=batch)
    a.claim()
    return a, b, ids


def test_a_cancel_of_an_owned_sequence_does_not_wait_out_the_commit_wait(replicas):
    """The cancel holds the claim lock until its commit: with two workers busy after it
    (each holds another sequence), it does not hold the lock for the whole wait (an hour
    here) for their saves."""
    a, b, ids = _two_workers_on_a(replicas, batch=2)

    async def scenario() -> tuple[bool, str]:
        servicer = replica_servicer.ReplicaServicer(
            a.core, Wakeups(), a.state, commit_wait_seconds=3600
        )
        a.core.select_batch(report("w1"))
        a.core.select_batch(report("w2"))
        await asyncio.wait_for(servicer._commits.committed(), 10)
        assert a.core.num_busy_workers() == 2
        # Safety limit only: a cancel that waited for w2's save would wait an hour.
        cancelled = await asyncio.wait_for(servicer._cancel(ids[0]), 10)
        await servicer._commits.close()
        return cancelled, b.state.sequence_info(ids[0]).state.name

    assert asyncio.run(scenario()) == (True, "FINISHED")


def test_a_replicas_commit_waits_for_the_saves_of_its_workers_and_no_longer(replicas):
    a, b, ids = _two_workers_on_a(replicas, batch=1)

    async def scenario() -> int:
        servicer = replica_servicer.ReplicaServicer(
            a.core, Wakeups(), a.state, commit_wait_seconds=3600
        )
        commits = servicer._commits
        a.core.select_batch(report("w1"))
        a.core.select_batch(report("w2"))
        await asyncio.wait_for(commits.committed(), 60)  # safety limit, not a timing
        before = a.state.num_commits
        a.core.select_batch(report("w1", running=(ids[0],), tokens={ids[0]: (4,)}))
        first = asyncio.ensure_future(commits.committed())
        await asyncio.sleep(0)  # w1's call waits: its commit gathers until w2 saves too
        a.core.select_batch(report("w2", running=(ids[1],), tokens={ids[1]: (5,)}))
        await asyncio.wait_for(asyncio.gather(first, commits.committed()), 60)
        await commits.close()
        return a.state.num_commits - before

    assert asyncio.run(scenario()) == 1
    assert [b.state.read_output(i, 0).token_ids for i in ids] == [(4,), (5,)]


def test_a_replicas_commit_does_not_wait_for_an_idle_worker(replicas):
    """w2 holds nothing (an idle worker waits in a long poll and saves nothing): w1's
    save commits without waiting for a save of w2's, whatever the wait's limit."""
    a, b = replicas("a"), replicas("b")
    seq_id = b.submit(max_new_tokens=8)
    register(a.core, "w1", max_batch_size=1)
    register(a.core, "w2", max_batch_size=1)
    a.claim()

    async def scenario() -> tuple[int, ...]:
        servicer = replica_servicer.ReplicaServicer(
            a.core, Wakeups(), a.state, commit_wait_seconds=3600
        )
        commits = servicer._commits
        a.core.select_batch(report("w1"))
        assert a.core.num_busy_workers() == 1
        # Safety limits only: the commit that would wait for w2 waits an hour.
        await asyncio.wait_for(commits.committed(), 10)
        a.core.select_batch(report("w1", running=(seq_id,), tokens={seq_id: (4,)}))
        await asyncio.wait_for(commits.committed(), 10)
        await commits.close()
        return b.state.read_output(seq_id, 0).token_ids

    assert asyncio.run(scenario()) == (4,)


def _gather_seconds(
    dues: list[float | None],
    *,
    max_wait: float,
    max_due_wait: float,
    later: float | None = None,
    late_due: float = 0.0,
    late_reader: bool = False,
) -> tuple[list[int], float, list[str]]:
    """Calls that save and wait for their commit with the given dues (None: no due), on
    ReplicaCommits that expects one save more than ever come (its wait is never cut short
    by "enough"); with `later`, one more call (due `late_due`; a reader that saved nothing
    with `late_reader`) that many seconds after the first. The saves each commit held,
    the seconds until the first commit ended, and how each commit's wait ended."""
    store = _CountingStore()
    outcomes: list[str] = []

    async def scenario() -> float:
        commits = ReplicaCommits(
            store,
            on_disowned=lambda ids: None,
            max_wait_seconds=max_wait,
            expected_saves=lambda: len(dues) + 2,
            max_due_wait_seconds=max_due_wait,
            on_commit=lambda num_saves, gathered: outcomes.append(gathered),
        )
        loop = asyncio.get_running_loop()
        started = loop.time()

        async def call(due: float | None, reader: bool = False) -> float:
            if not reader:
                store.save()
            await commits.committed(due_seconds=due or 0.0, reader=reader)
            return loop.time() - started

        waiting = [asyncio.ensure_future(call(due)) for due in dues]
        await asyncio.sleep(0)
        if later is not None:
            await asyncio.sleep(later)
            waiting.append(asyncio.ensure_future(call(late_due, late_reader)))
        # A safety limit only: a wait that is not cut short lasts an hour.
        ends = await asyncio.wait_for(asyncio.gather(*waiting), 10)
        await commits.close()
        return min(ends)

    seconds = asyncio.run(scenario())
    return store.commits, seconds, outcomes


def test_a_commit_whose_callers_all_answer_later_waits_longer_up_to_its_limit():
    commits, seconds, outcomes = _gather_seconds([0.5, 0.5], max_wait=0.01, max_due_wait=0.2)
    assert (commits, outcomes) == ([2], ["expired"])
    assert seconds >= 0.19  # the due wait's limit, not the plain 10 ms


def test_a_commit_never_waits_past_its_earliest_due_less_a_margin():
    commits, seconds, outcomes = _gather_seconds([0.3, 3600], max_wait=0.0, max_due_wait=3600)
    # The earlier due, less the margin, ended the wait ("due"): well before the limit.
    assert (commits, outcomes) == ([2], ["due"])
    assert 0.25 <= seconds < 1


def test_one_caller_without_a_due_keeps_the_commit_to_the_plain_wait():
    # An hour's due and limit: only the plain caller's 10 ms ends the wait in time.
    commits, _, outcomes = _gather_seconds([3600, None, 3600], max_wait=0.01, max_due_wait=3600)
    assert (commits, outcomes) == ([3], ["expired"])


def test_a_caller_without_a_due_arriving_mid_wait_brings_the_commit_forward():
    commits, seconds, _ = _gather_seconds(
        [3600], max_wait=0.01, max_due_wait=3600, later=0.05, late_due=0.0
    )
    assert commits == [2]
    assert seconds >= 0.05


def test_a_caller_joining_the_wait_ends_it_where_it_would_have_ended_before():
    # The plain wait runs from the gather's start (0.3 s), not from the caller's arrival.
    commits, seconds, outcomes = _gather_seconds(
        [3600], max_wait=0.3, max_due_wait=3600, later=0.2, late_due=0.0
    )
    assert (commits, outcomes) == ([2], ["expired"])
    assert 0.29 <= seconds < 0.45


def test_a_stream_waiting_for_a_commit_does_not_cut_its_wait_short():
    # A reader saved nothing: the worker's due (0.5 s, limit 0.4 s) still sets the wait.
    commits, seconds, _ = _gather_seconds(
        [0.5], max_wait=0.01, max_due_wait=0.4, later=0.05, late_reader=True
    )
    assert commits == [1]
    assert seconds >= 0.39


def test_dues_are_ignored_when_the_due_wait_is_off():
    commits, _, _ = _gather_seconds([3600, 3600], max_wait=0.01, max_due_wait=0.0)
    assert commits == [2]


def test_a_replica_passes_a_reports_answer_due_to_its_commit(replicas):
    """Two busy workers; w1 reports with its answer due in 10 s: its commit waits for w2's
    save up to the due wait (0.3 s here) instead of starting at once (no plain wait)."""
    a, b, ids = _two_workers_on_a(replicas, batch=1)

    async def scenario() -> tuple[float, float]:
        servicer = replica_servicer.ReplicaServicer(
            a.core, Wakeups(), a.state, commit_wait_seconds=0.0, commit_due_wait_seconds=0.3
        )
        loop = asyncio.get_running_loop()
        a.core.select_batch(report("w1"))
        a.core.select_batch(report("w2"))
        await asyncio.wait_for(servicer._commits.committed(), 10)
        took = []
        for n, due_us in enumerate((10_000_000, 0)):
            a.core.select_batch(report("w1", running=(ids[0],), tokens={ids[0]: (4 + n,)}))
            started = loop.time()
            request = pb.SelectBatchRequest(worker_id="w1", answer_due_us=due_us)
            await asyncio.wait_for(servicer._answer_durable(request, time.perf_counter()), 10)
            took.append(loop.time() - started)
        await servicer._commits.close()
        return took[0], took[1]

    with_due, without = asyncio.run(scenario())
    assert with_due >= 0.29
    assert without < 0.29


def test_a_due_wait_below_the_plain_wait_never_shortens_it():
    commits, seconds, _ = _gather_seconds([3600, 3600], max_wait=0.2, max_due_wait=0.01)
    assert commits == [2]
    assert seconds >= 0.19
