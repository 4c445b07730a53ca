"""The budget and fair policies (contract, "Policies"), rule by rule, on the core."""

from __future__ import annotations

import pytest

from service.core import (
    InvalidArgument,
    PreemptReason,
    Scheduler,
    SequenceState,
    SubmitParams,
)
from service.core.observer import SchedulerObserver

from .factories import (
    FakeClock,
    finished,
    make_config,
    make_scheduler,
    prefill_ids,
    register,
    report,
    submit,
)


def budget_scheduler(policy="budget", clock=None, **overrides):
    config = dict(
        policy=policy,
        max_batch_size=8,
        max_num_batched_tokens=64,
        min_prefill_chunk=8,
        chunk_size=512,
        kv_watermark_pages=1,
    )
    config.update(overrides)
    return make_scheduler(clock=clock, **config)


# ----------------------------------------------------------------- budget: batching


def test_admissions_stop_at_the_token_budget_with_a_shortened_last_chunk():
    sched = budget_scheduler()
    register(sched)
    ids = [submit(sched, prompt_len=40, max_new_tokens=4) for _ in range(3)]
    decision = sched.select_batch(report())
    # 40 tokens, then the 24 left of the budget of 64 (>= min_prefill_chunk 8).
    assert [(c.seq_id, c.chunk_start, c.chunk_len) for c in decision.prefill] == [
        (ids[0], 0, 40),
        (ids[1], 0, 24),
    ]
    assert sched.get_sequence(ids[2]).state is SequenceState.QUEUED


def test_a_first_chunk_below_min_prefill_chunk_is_not_started_but_short_prompts_still_fit():
    sched = budget_scheduler(max_num_batched_tokens=64, min_prefill_chunk=16)
    register(sched)
    big = [submit(sched, prompt_len=60, max_new_tokens=4), submit(sched, prompt_len=60)]
    small = submit(sched, prompt_len=4)
    decision = sched.select_batch(report())
    # 60 tokens; the second would get 4 < 16 tokens and waits; the 4-token prompt fits.
    assert [(c.seq_id, c.chunk_len) for c in decision.prefill] == [(big[0], 60), (small, 4)]
    assert sched.get_sequence(big[1]).state is SequenceState.QUEUED


def test_every_running_sequence_decodes_and_costs_one_token_of_the_budget():
    sched = budget_scheduler(max_batch_size=8, max_num_batched_tokens=16, min_prefill_chunk=1)
    register(sched)
    running = [submit(sched, prompt_len=2, max_new_tokens=50) for _ in range(6)]
    sched.select_batch(report())
    queued = submit(sched, prompt_len=30, max_new_tokens=4)
    decision = sched.select_batch(report(running=running))
    assert decision.decode == tuple(running)
    # 16 - 6 decodes = 10 tokens left for the 30-token prompt.
    assert [(c.seq_id, c.chunk_len) for c in decision.prefill] == [(queued, 10)]


def test_continuations_go_oldest_admission_first_and_share_what_is_left():
    sched = budget_scheduler(max_num_batched_tokens=32, min_prefill_chunk=8)
    register(sched)
    first, second = submit(sched, prompt_len=100), submit(sched, prompt_len=100)
    decision = sched.select_batch(report())
    assert [(c.seq_id, c.chunk_len) for c in decision.prefill] == [(first, 32)]
    decision = sched.select_batch(report(waiting=[first]))
    assert [(c.seq_id, c.chunk_start, c.chunk_len) for c in decision.prefill] == [(first, 32, 32)]
    decision = sched.select_batch(report(waiting=[first]))  # 96 handed out
    # 4 tokens finish the first prompt; 28 left: second is admitted with them.
    decision = sched.select_batch(report(waiting=[first]))
    assert [(c.seq_id, c.chunk_start, c.chunk_len) for c in decision.prefill] == [
        (second, 0, 28),
        (first, 96, 4),
    ]


def test_the_token_budget_is_never_exceeded_with_many_prefills_and_decodes():
    sched = budget_scheduler(max_batch_size=16, max_num_batched_tokens=40, min_prefill_chunk=4)
    register(sched, max_batch_size=16)
    for _ in range(20):
        submit(sched, prompt_len=25, max_new_tokens=3)
    held_waiting, held_running = [], []
    for _ in range(30):
        decision = sched.select_batch(report(waiting=held_waiting, running=held_running))
        assert len(decision.decode) + sum(c.chunk_len for c in decision.prefill) <= 40
        cursor = {c.seq_id: c.chunk_start + c.chunk_len for c in decision.prefill}
        held_waiting = [
            s
            for s in [*held_waiting, *cursor]
            if s in cursor and cursor[s] < sched.get_sequence(s).prompt_len
        ] + [s for s in held_waiting if s not in cursor]
        held_waiting = list(dict.fromkeys(held_waiting))
        held_running = [
            *held_running,
            *(s for s, end in cursor.items() if end == sched.get_sequence(s).prompt_len),
        ]


def test_a_worker_may_not_run_more_sequences_than_the_token_budget():
    sched = budget_scheduler(max_batch_size=8, max_num_batched_tokens=64)
    settings = register(sched, max_batch_size=1000)
    assert settings.max_batch_size == 64


# ----------------------------------------------------------------- budget: KV pages


def test_admission_needs_its_first_chunks_pages_within_free_pages_less_the_watermark():
    sched = budget_scheduler(kv_watermark_pages=2, max_num_batched_tokens=256)
    register(sched)
    seq = submit(sched, prompt_len=50)  # 4 pages of 16
    assert prefill_ids(sched.select_batch(report(kv_free_pages=5))) == []
    assert sched.get_sequence(seq).state is SequenceState.QUEUED
    assert prefill_ids(sched.select_batch(report(kv_free_pages=6))) == [seq]


def test_continuations_are_shortened_to_the_pages_left():
    sched = budget_scheduler(kv_watermark_pages=1, max_num_batched_tokens=256)
    register(sched)
    seq = submit(sched, prompt_len=200)
    assert [c.chunk_len for c in sched.select_batch(report(kv_free_pages=20)).prefill] == [200]
    sched = budget_scheduler(kv_watermark_pages=1, max_num_batched_tokens=64)
    register(sched)
    seq = submit(sched, prompt_len=200)
    sched.select_batch(report())  # 64 tokens: 4 pages
    # 3 free pages less 1 of watermark = 2 pages = 32 tokens.
    decision = sched.select_batch(report(waiting=[seq], kv_free_pages=3))
    assert [(c.chunk_start, c.chunk_len) for c in decision.prefill] == [(64, 32)]


def decoding(sched, num, prompt_len, worker_id="w0", **submit_overrides):
    """`num` sequences admitted and prefilled in one chunk each; they now decode."""
    ids = [
        submit(sched, prompt_len=prompt_len, max_new_tokens=100, **submit_overrides)
        for _ in range(num)
    ]
    decision = sched.select_batch(report(worker_id))
    assert prefill_ids(decision) == ids
    return ids


def test_decodes_that_cross_a_page_boundary_preempt_the_latest_admitted_until_the_rest_fit():
    sched = budget_scheduler(kv_watermark_pages=1)
    register(sched)
    ids = decoding(sched, 3, prompt_len=16)  # 16 positions = 1 page each
    # Each holds 16 tokens + 1 sampled: the next decode writes position 16, a new page.
    tokens = {s: [7] for s in ids}
    decision = sched.select_batch(report(running=ids, kv_free_pages=2, tokens=tokens))
    # 3 new pages needed, 2 - 1 free: preempt the latest admitted, freeing its page.
    assert decision.preempt == (ids[2],)
    assert decision.decode == tuple(ids[:2])
    assert sched.get_sequence(ids[2]).state is SequenceState.QUEUED


def test_preemption_victims_are_lowest_urgency_first():
    sched = budget_scheduler(kv_watermark_pages=1)
    register(sched)
    urgent = submit(sched, prompt_len=16, max_new_tokens=100, priority=-1)
    relaxed = submit(sched, prompt_len=16, max_new_tokens=100, priority=5)
    normal = submit(sched, prompt_len=16, max_new_tokens=100)
    sched.select_batch(report())
    ids = [urgent, relaxed, normal]
    decision = sched.select_batch(
        report(running=ids, kv_free_pages=2, tokens={s: [7] for s in ids})
    )
    assert decision.preempt == (relaxed,)


def test_a_preempted_sequence_resumes_from_its_tokens_so_far():
    sched = budget_scheduler(kv_watermark_pages=1)
    register(sched)
    ids = decoding(sched, 2, prompt_len=16)
    decision = sched.select_batch(
        report(running=ids, kv_free_pages=1, tokens={s: [7] for s in ids})
    )
    assert decision.preempt == (ids[1],)
    decision = sched.select_batch(report(running=[ids[0]], tokens={ids[0]: [8]}))
    resumed = [c for c in decision.prefill if c.seq_id == ids[1]]
    assert resumed and resumed[0].spec.prompt_token_ids[-1] == 7
    assert resumed[0].spec.max_new_tokens == 99


def test_preemptions_are_counted_by_reason():
    counted = []

    class Listener(SchedulerObserver):
        def on_preempted(self, seq_id, worker_id, reason):
            counted.append(reason)

    sched = Scheduler(
        make_config(policy="budget", kv_watermark_pages=1), clock=FakeClock(), observer=Listener()
    )
    register(sched)
    ids = decoding(sched, 2, prompt_len=16)
    sched.select_batch(report(running=ids, kv_free_pages=1, tokens={s: [7] for s in ids}))
    sched.select_batch(report(running=[], preempted=[ids[0]]))
    assert counted == [PreemptReason.KV_GROWTH, PreemptReason.WORKER]


def test_prefills_that_only_wait_on_each_others_pages_are_unstuck():
    sched = budget_scheduler(kv_watermark_pages=1, max_num_batched_tokens=64)
    register(sched)
    first, second = submit(sched, prompt_len=80), submit(sched, prompt_len=200)
    sched.select_batch(report())  # first: 64 tokens
    decision = sched.select_batch(report(waiting=[first]))
    # second's 48 tokens fill its 3 pages: it cannot go on without a new page.
    assert [(c.seq_id, c.chunk_len) for c in decision.prefill] == [(second, 48), (first, 16)]
    # Nothing decodes, and the prefill left waits for pages that are all taken: the
    # latest admitted goes back to the queue (its pages with it).
    decision = sched.select_batch(report(waiting=[first, second], kv_free_pages=0))
    assert decision.preempt == (second,) and decision.prefill == ()


def test_a_lone_prefill_gets_its_chunk_whatever_the_pages():
    sched = budget_scheduler(kv_watermark_pages=1, max_num_batched_tokens=64)
    register(sched)
    seq = submit(sched, prompt_len=200)
    sched.select_batch(report())
    # The worker then preempts or fails it, as fifo's empty-batch rule lets it.
    decision = sched.select_batch(report(waiting=[seq], kv_free_pages=0))
    assert [(c.seq_id, c.chunk_start, c.chunk_len) for c in decision.prefill] == [(seq, 64, 64)]


# ----------------------------------------------------------------- every policy


@pytest.mark.parametrize("policy", ["fifo", "budget", "fair"])
def test_the_lora_limit_skips_a_third_adapter_without_blocking_the_queue(policy):
    sched = budget_scheduler(policy=policy, max_loras=2, max_num_batched_tokens=512)
    register(sched, adapters=("a", "b", "c"))
    a, b, c = (submit(sched, adapter_id=x) for x in "abc")
    base, a2 = submit(sched), submit(sched, adapter_id="a")
    decision = sched.select_batch(report())
    assert prefill_ids(decision) == [a, b, base, a2]
    assert sched.get_sequence(c).state is SequenceState.QUEUED
    # Once a's sequences finish, c fits.
    decision = sched.select_batch(report(waiting=[b, base], finished=[finished(a), finished(a2)]))
    assert c in prefill_ids(decision)


@pytest.mark.parametrize("policy", ["fifo", "budget", "fair"])
def test_a_decision_never_exceeds_the_message_limit(policy):
    sched = Scheduler(
        make_config(
            policy=policy,
            max_batch_size=64,
            max_seq_len=4096,
            max_num_batched_tokens=1 << 20,
            min_prefill_chunk=1,
        ),
        clock=FakeClock(),
        max_decision_bytes=64 * 1024,
    )
    register(sched, max_batch_size=64)
    ids = [submit(sched, prompt_len=4000, max_new_tokens=8) for _ in range(10)]
    decision = sched.select_batch(report(kv_free_pages=10**6, gdn_free_slots=64))
    # A 4,000-token spec takes at most ~20 KB: three fit in 64 KB, the rest wait.
    assert prefill_ids(decision) == ids[:3]
    assert all(sched.get_sequence(s).state is SequenceState.QUEUED for s in ids[3:])
    small = Scheduler(make_config(policy=policy), clock=FakeClock(), max_decision_bytes=16 * 1024)
    with pytest.raises(InvalidArgument, match="may not fit in one decision"):
        small.submit(SubmitParams(prompt_token_ids=tuple(range(4000)), max_new_tokens=96))


@pytest.mark.parametrize("policy", ["fifo", "budget", "fair"])
def test_a_report_listing_more_than_twice_the_batch_is_refused_before_any_work(policy):
    sched = budget_scheduler(policy=policy, max_batch_size=4)
    register(sched, max_batch_size=4)
    seq = submit(sched)
    with pytest.raises(InvalidArgument, match="at most 8"):
        sched.select_batch(report(running=list(range(1000, 1009))))
    assert sched.get_sequence(seq).state is SequenceState.QUEUED
    assert sched.status().workers[0].iteration == 0


def test_prompts_are_held_compactly():
    sched = budget_scheduler()
    seq_id = submit(sched, prompt_len=4000, max_new_tokens=8)
    prompt = sched._sequences.get(seq_id).params.prompt_token_ids
    assert prompt.itemsize == 4 and len(prompt) == 4000
    with pytest.raises(InvalidArgument, match="prompt_token_ids"):
        sched.submit(SubmitParams(prompt_token_ids=(1, 2**32), max_new_tokens=1))


# ----------------------------------------------------------------- fair: the order


def fair_scheduler(clock=None, **overrides):
    overrides.setdefault("max_num_batched_tokens", 512)
    return budget_scheduler(policy="fair", clock=clock or FakeClock(), **overrides)


def admitted_order(sched, worker_id="w0"):
    return prefill_ids(sched.select_batch(report(worker_id)))


def test_fair_serves_the_most_urgent_band_first():
    sched = fair_scheduler()
    register(sched)
    later = submit(sched, priority=2)
    urgent = submit(sched, priority=-3)
    normal = submit(sched, priority=0)
    assert admitted_order(sched) == [urgent, normal, later]


def test_fair_ages_a_waiting_sequence_one_band_per_aging_period():
    clock = FakeClock()
    sched = fair_scheduler(
        clock=clock, aging_seconds=10.0, max_batch_size=1, max_num_batched_tokens=64
    )
    register(sched, max_batch_size=1)
    old = submit(sched, priority=2)
    clock.advance_ms(20_000)  # two periods: band 0
    newer = submit(sched, priority=0)
    # Same band; inside it the same tenant is first come first served.
    assert sched.get_sequence(old).queue_position == 0
    assert sched.get_sequence(newer).queue_position == 1
    clock.advance_ms(5_000)
    fresh_urgent = submit(sched, priority=-1)
    assert sched.get_sequence(fresh_urgent).queue_position == 0


def test_fair_serves_tenants_by_least_tokens_served():
    sched = fair_scheduler(max_batch_size=8)
    register(sched)
    a = [submit(sched, prompt_len=10, tenant="a") for _ in range(3)]
    b = [submit(sched, prompt_len=10, tenant="b") for _ in range(3)]
    # Alternates inside one decision: each admission charges its tenant.
    assert admitted_order(sched) == [a[0], b[0], a[1], b[1], a[2], b[2]]


def test_fair_weights_give_a_heavier_tenant_a_larger_share():
    sched = fair_scheduler(max_batch_size=9, tenant_weights=(("gold", 2.0),))
    register(sched, max_batch_size=9)
    gold = [submit(sched, prompt_len=10, tenant="gold") for _ in range(6)]
    plain = [submit(sched, prompt_len=10, tenant="plain") for _ in range(6)]
    order = admitted_order(sched)
    assert len(order) == 9
    assert sum(1 for s in order if s in gold) == 6 and sum(1 for s in order if s in plain) == 3


def test_a_newly_active_tenant_starts_at_the_lowest_active_counter():
    sched = fair_scheduler(max_batch_size=1, max_num_batched_tokens=64)
    register(sched, max_batch_size=1)
    a1 = submit(sched, prompt_len=10, tenant="a")
    assert admitted_order(sched) == [a1]  # a has 10 tokens served
    sched.select_batch(report(finished=[finished(a1)]))
    b1 = submit(sched, prompt_len=10, tenant="b")  # the only active tenant: starts at 0
    a2 = submit(sched, prompt_len=10, tenant="a")  # inactive: lifted to b's 0, stays 10
    assert sched.get_sequence(b1).queue_position == 0
    assert sched.get_sequence(a2).queue_position == 1
    late = submit(sched, prompt_len=10, tenant="c")  # starts at min(0, 10) = 0
    assert sched.get_sequence(late).queue_position == 1  # after b1 (earlier), before a2


def test_fair_requeue_keeps_the_original_arrival():
    sched = fair_scheduler(max_batch_size=1, max_num_batched_tokens=64)
    register(sched, max_batch_size=1)
    first = submit(sched, prompt_len=10, tenant="a")
    assert admitted_order(sched) == [first]
    second = submit(sched, prompt_len=10, tenant="a")
    sched.select_batch(report(preempted=[first], draining=True))
    assert sched.get_sequence(first).queue_position == 0
    assert sched.get_sequence(second).queue_position == 1


def test_queue_positions_follow_the_fair_order():
    sched = fair_scheduler()
    ids = [
        submit(sched, priority=p, tenant=t)
        for p, t in [(1, "a"), (0, "b"), (0, "a"), (-1, "c"), (1, "b")]
    ]
    positions = [sched.get_sequence(s).queue_position for s in ids]
    assert positions == [3, 1, 2, 0, 4]


def test_a_queued_4000_token_prompt_costs_at_most_20_kib():
    import random
    import tracemalloc

    sched = budget_scheduler(max_queue=1000)
    rnd = random.Random(3)
    prompts = [[rnd.randrange(1_000, 150_000) for _ in range(4000)] for _ in range(50)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for prompt in prompts:
            sched.submit(SubmitParams(prompt_token_ids=prompt, max_new_tokens=8))
        per_sequence = (tracemalloc.get_traced_memory()[0] - before) / len(prompts)
    finally:
        tracemalloc.stop()
    # 16,000 bytes of token ids, and a small fixed cost per sequence (it was ~158 KB).
    assert 16_000 <= per_sequence <= 20 * 1024, per_sequence
