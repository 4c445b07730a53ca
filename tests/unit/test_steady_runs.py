"""A steady step (packed runs of one token for each sequence, as the last report's) is
applied from the worker's SteadyRuns, checked with list comparisons instead of sequence by
sequence. Whatever the reports, the outcome is the general rules': each token
once, a gap refused whole, a sequence that left or came back checked anew."""

import copy
import random
from contextlib import contextmanager

import pytest

from service.core import InvalidArgument, TokenRuns, WorkerReport
from service.core.tables.steady import SteadyStep
from service.core.types import FinishReason
from tests.unit.factories import admit, finished, make_scheduler, register, submit


def _running(num: int = 3):
    sched = make_scheduler()
    register(sched)
    seq_ids = tuple(submit(sched, prompt_len=4, max_new_tokens=100) for _ in range(num))
    admit(sched)
    return sched, seq_ids


def _step(sched, running, token_ids, offsets, runs_of=None, **fields):
    """A report of `running` with a token each for `runs_of` (default: `running`)."""
    return sched.select_batch(
        WorkerReport(
            "w0",
            running=tuple(running),
            kv_free_pages=100,
            gdn_free_slots=8,
            token_runs=TokenRuns(
                list(running if runs_of is None else runs_of),
                list(token_ids),
                offsets=list(offsets),
            ),
            **fields,
        )
    )


def _outputs(sched, seq_ids):
    return [sched.read_output(s, 0).token_ids for s in seq_ids]


def _steady(sched):
    return sched._ledger.get("w0").steady_runs


def test_repeated_steady_steps_use_the_kept_runs_and_add_each_token_once():
    sched, ids = _running()
    _step(sched, ids, (11, 21, 31), (0, 0, 0))
    kept = _steady(sched)
    assert kept is not None
    _step(sched, ids, (12, 22, 32), (1, 1, 1))
    _step(sched, ids, (13, 23, 33), (2, 2, 2))
    assert _steady(sched) is kept  # the same step applied from it, not rebuilt
    assert kept.num_known == [3, 3, 3]
    assert _outputs(sched, ids) == [(11, 12, 13), (21, 22, 23), (31, 32, 33)]


def test_a_retried_steady_step_adds_nothing_twice_and_a_gap_refuses_it_whole():
    sched, ids = _running()
    _step(sched, ids, (11, 21, 31), (0, 0, 0))
    _step(sched, ids, (12, 22, 32), (1, 1, 1))
    _step(sched, ids, (12, 22, 32), (1, 1, 1))  # its answer was lost: sent again
    with pytest.raises(InvalidArgument, match=r"token_offsets\[2\]: seq_id .* offset 4"):
        _step(sched, ids, (13, 23, 34), (2, 2, 4))
    _step(sched, ids, (13, 23, 33), (2, 2, 2))
    assert _outputs(sched, ids) == [(11, 12, 13), (21, 22, 23), (31, 32, 33)]


def test_a_cancelled_sequence_in_a_steady_step_gets_no_token():
    sched, (a, b, c) = _running()
    _step(sched, (a, b, c), (11, 21, 31), (0, 0, 0))
    sched.cancel(b)
    _step(sched, (a, b, c), (12, 22, 32), (1, 1, 1))  # the worker has not heard yet
    assert _outputs(sched, (a, b, c)) == [(11, 12), (21,), (31, 32)]


def test_a_sequence_preempted_and_admitted_again_is_checked_from_its_new_admission():
    sched, (a, b, c) = _running()
    _step(sched, (a, b, c), (11, 21, 31), (0, 0, 0))
    _step(sched, (a, b, c), (12, 22, 32), (1, 1, 1))
    # The worker gives a back; the same worker takes it again at once (the queue's head).
    decision = _step(sched, (b, c), (23, 33), (2, 2), preempted=(a,))
    assert [chunk.seq_id for chunk in decision.prefill if chunk.spec is not None] == [a]
    # Its tokens now count from 0: an offset carried over from before is a gap.
    with pytest.raises(InvalidArgument, match=rf"seq_id {a} offset 2 is beyond the 0"):
        _step(sched, (a, b, c), (13, 24, 34), (2, 3, 3))
    _step(sched, (a, b, c), (13, 24, 34), (0, 3, 3))
    assert _outputs(sched, (a, b, c)) == [(11, 12, 13), (21, 22, 23, 24), (31, 32, 33, 34)]


def test_a_sequence_given_back_with_its_last_token_and_admitted_again_counts_anew():
    """Its last token and its preemption in one report, the same runs as the step before,
    and the same worker takes it back in the answer: the next step's runs are the kept
    ones again, but its offsets count from its new admission."""
    sched, (a, b, c) = _running()
    _step(sched, (a, b, c), (11, 21, 31), (0, 0, 0))
    decision = _step(sched, (b, c), (12, 22, 32), (1, 1, 1), runs_of=(a, b, c), preempted=(a,))
    assert [chunk.seq_id for chunk in decision.prefill if chunk.spec is not None] == [a]
    with pytest.raises(InvalidArgument, match=rf"seq_id {a} offset 2 is beyond the 0"):
        _step(sched, (a, b, c), (13, 23, 33), (2, 2, 2))
    _step(sched, (a, b, c), (13, 23, 33), (0, 2, 2))
    assert _outputs(sched, (a, b, c)) == [(11, 12, 13), (21, 22, 23), (31, 32, 33)]


def test_a_finished_sequence_leaves_the_steady_step():
    sched, (a, b, c) = _running()
    _step(sched, (a, b, c), (11, 21, 31), (0, 0, 0))
    _step(
        sched,
        (a, c),
        (12, 22, 32),
        (1, 1, 1),
        runs_of=(a, b, c),
        finished=(finished(b, FinishReason.EOS, 2),),
    )
    _step(sched, (a, c), (13, 33), (2, 2))
    _step(sched, (a, c), (14, 34), (3, 3))
    assert _steady(sched) is not None
    assert _outputs(sched, (a, b, c)) == [(11, 12, 13, 14), (21, 22), (31, 32, 33, 34)]


def _random_reports(rnd: random.Random, ids: tuple[int, ...], num: int):
    """Reports a worker could send, honest or not: steady steps, retries, gaps, strays,
    a sequence named twice, another order, no offsets, counts."""
    sent = dict.fromkeys(ids, 0)
    for step in range(num):
        kind = rnd.choice(
            ["steady"] * 6 + ["retry", "gap", "stray", "twice", "order", "no offsets", "counts"]
        )
        order = list(ids)
        if kind == "order":
            rnd.shuffle(order)
        if kind == "retry":
            offsets = [max(0, sent[s] - 1) for s in order]
        else:
            offsets = [sent[s] for s in order]
        if kind == "gap":
            offsets[rnd.randrange(len(order))] += 2
        counts = []
        if kind == "stray":
            order.append(10_000)
            offsets.append(0)
        if kind == "twice":
            order.append(order[0])
            offsets.append(offsets[0] + 1)
        if kind == "counts":
            counts = [rnd.randint(1, 2) for _ in order]
        token_ids = [100 * step + i for i in range(sum(counts) if counts else len(order))]
        runs = TokenRuns(
            order, token_ids, counts=counts, offsets=[] if kind == "no offsets" else offsets
        )
        yield kind, runs, sent


@pytest.mark.parametrize("seed", range(6))
def test_random_reports_give_what_the_general_rules_give(seed, monkeypatch):
    """The same reports to a scheduler with the steady path and one without: the same
    decisions, outputs and refusals, report by report."""

    def run(steady_path: bool):
        sched, ids = _running(4)
        rnd = random.Random(seed)
        outcomes = []
        with monkeypatch.context() as patch:
            if not steady_path:
                patch.setattr(SteadyStep, "match", staticmethod(lambda worker, report: None))
                patch.setattr(SteadyStep, "kept_running", staticmethod(lambda worker, report: None))
            for kind, runs, sent in _random_reports(rnd, ids, 60):
                try:
                    decision = sched.select_batch(
                        WorkerReport(
                            "w0", running=ids, kv_free_pages=100, gdn_free_slots=8, token_runs=runs
                        )
                    )
                    outcomes.append((kind, decision.decode, decision.prefill))
                except InvalidArgument as err:
                    outcomes.append((kind, str(err)))
                for s in ids:  # the worker's count: what the scheduler holds now
                    sent[s] = len(sched.read_output(s, 0).token_ids)
        return outcomes, _outputs(sched, ids)

    assert run(steady_path=True) == run(steady_path=False)


@contextmanager
def _plans_seen(monkeypatch, steady_path: bool):
    """A scheduler with four sequences running, three a token apart from the fourth (the
    count of pages their decodes start goes 3, 0, 0, 1, or 3, 1, 0, 0 read backwards,
    every four steps), whose policy notes each view it plans from (running ids, running
    records' ids, pages): (scheduler, ids, views). `steady_path` False: no decision is
    made from a kept steady step."""
    sched = make_scheduler()
    register(sched, page_size=4)
    ids = tuple(submit(sched, prompt_len=n, max_new_tokens=100) for n in (3, 3, 3, 4))
    admit(sched)
    seen = []
    policy = sched._policy
    plan = policy.plan

    def spy(view):
        seen.append((view.running_ids, [s.seq_id for s in view.running], view.decode_pages))
        return plan(view)

    with monkeypatch.context() as patch:
        patch.setattr(policy, "plan", spy)
        if not steady_path:
            patch.setattr(SteadyStep, "kept_running", staticmethod(lambda worker, report: None))
        yield sched, ids, seen


@pytest.mark.parametrize("stray", [False, True])
def test_steady_decisions_count_the_pages_a_pass_over_the_sequences_counts(stray, monkeypatch):
    """The decision's view of a steady step (its running records, ids and the pages
    their next decodes start) is the one the pass over them builds, step after step;
    also when the running list names an id that is not the worker's (evicted)."""

    def views(steady_path: bool):
        with _plans_seen(monkeypatch, steady_path) as (sched, ids, seen):
            running = (*ids, 9999) if stray else ids
            for step in range(30):
                _step(sched, running, [step] * len(ids), [step] * len(ids), runs_of=ids)
        kept = _steady(sched)
        return seen, kept is not None and kept.page_residues is not None

    seen, used = views(steady_path=True)
    reference, _ = views(steady_path=False)
    assert seen == reference
    assert used == (not stray)  # steady decisions made from the kept runs, stray aside
    pages = [num for _, _, num in seen]
    assert len(set(pages)) > 1  # the count moves step by step


def test_a_record_replaced_by_an_equal_one_is_not_taken_for_the_kept_one():
    """The kept records are compared by identity: a record with the same fields (a copy
    put in its place) gets its token through the general path, not the kept array."""
    sched, (a, b) = _running(2)
    _step(sched, (a, b), (11, 21), (0, 0))
    worker = sched._ledger.get("w0")
    twin = copy.deepcopy(worker.assigned[a])
    worker.assigned[a] = sched._sequences._by_id[a] = twin
    _step(sched, (a, b), (12, 22), (1, 1))
    assert _outputs(sched, (a, b)) == [(11, 12), (21, 22)]


@pytest.mark.parametrize("steady", [True, False], ids=["steady", "general"])
def test_a_step_with_an_id_out_of_range_is_refused_with_none_of_its_tokens_added(steady):
    """Refused as bad input before any token is added (the in-process API takes any int;
    the wire's uint32 cannot say it), whichever way the step goes: the step sent again,
    mended, adds each token once."""
    sched, ids = _running()
    if steady:
        _step(sched, ids, (11, 21, 31), (0, 0, 0))
    with pytest.raises(InvalidArgument, match=r"token_ids must be integers within 0-4294967295"):
        _step(sched, ids, (12, 2**32, 32), (1, 1, 1) if steady else (0, 0, 0))
    _step(sched, ids, (12, 22, 32), (1, 1, 1) if steady else (0, 0, 0))
    assert _outputs(sched, ids) == (
        [(11, 12), (21, 22), (31, 32)] if steady else [(12,), (22,), (32,)]
    )


def _late_ask(sched, running):
    """The second report of a late pair (docs/contract.md, "Late decisions"): no tokens."""
    return sched.select_batch(
        WorkerReport("w0", running=tuple(running), kv_free_pages=100, gdn_free_slots=8)
    )


def test_late_pairs_keep_the_steady_step_and_decide_as_the_pass_does(monkeypatch):
    """A deferred report with the step's tokens, then one with none: the kept step is
    still the one the next tokens are applied from, and the late ask's decision sees
    the running records and pages that a pass over them sees."""

    def run(steady_path: bool):
        kept = []
        with _plans_seen(monkeypatch, steady_path) as (sched, ids, seen):
            for step in range(12):
                _step(sched, ids, [step] * len(ids), [step] * len(ids), decide_later=True)
                decision = _late_ask(sched, ids)
                assert decision.decode == ids
                kept.append(_steady(sched))
        return seen, kept, _outputs(sched, ids)

    seen, kept, outputs = run(steady_path=True)
    reference, _, reference_outputs = run(steady_path=False)
    assert (seen, outputs) == (reference, reference_outputs)
    assert outputs[0] == tuple(range(12))
    assert kept[1] is not None and all(k is kept[1] for k in kept[1:])  # never rebuilt


def test_a_sequence_cancelled_within_a_late_pair_is_evicted_not_decoded():
    sched, (a, b, c) = _running()
    _step(sched, (a, b, c), (11, 21, 31), (0, 0, 0))
    _step(sched, (a, b, c), (12, 22, 32), (1, 1, 1))  # a steady decision: its view kept
    _step(sched, (a, b, c), (13, 23, 33), (2, 2, 2), decide_later=True)
    sched.cancel(b)
    decision = _late_ask(sched, (a, b, c))
    assert (decision.decode, decision.evict) == ((a, c), (b,))
    _step(sched, (a, c), (14, 34), (3, 3))
    assert _outputs(sched, (a, b, c)) == [(11, 12, 13, 14), (21, 22, 23), (31, 32, 33, 34)]
