"""The handoff decision rule and placement by role (service/core/decide/handoff.py)."""

from __future__ import annotations

import pytest

from service.core import WorkerRole
from service.core.decide.handoff import (
    HandoffInput,
    HandoffReason,
    HandoffSettings,
    ModelShape,
    WorkerLoad,
    choose_handoff,
    pick_decode_worker,
    pick_prefill_worker,
)

# Qwen3-Next-80B-A3B: 12 attention layers (2 KV heads x 256, bf16), 36 GDN layers
# (32 value heads x 128 x 128 fp32 recurrent state, plus the bf16 convolution state).
HYBRID = ModelShape(12, 2 * 2 * 256 * 2, 36, 32 * 128 * 128 * 4 + 8192 * 3 * 2)
ATTENTION_ONLY = ModelShape(48, 2 * 2 * 256 * 2)
GB = 1e9


def request(**overrides) -> HandoffInput:
    fields = dict(
        prompt_tokens=8000,
        cached_tokens=0,
        prefill_seconds=2.0,
        num_decoding=30,
        transfer_bytes_per_second=12.5 * GB,
    )
    return HandoffInput(**{**fields, **overrides})


def test_long_prompt_beside_busy_decodes_is_handed_off():
    choice = choose_handoff(request(), HYBRID, HandoffSettings())
    assert choice.handoff and choice.reason is HandoffReason.PAYS
    assert choice.num_bytes == HYBRID.handoff_bytes(8001)
    assert choice.transfer_seconds == pytest.approx(choice.num_bytes / (12.5 * GB) + 0.001)
    assert choice.decode_seconds_saved == pytest.approx(60.0)


def test_short_prompt_stays_colocated():
    choice = choose_handoff(request(prompt_tokens=500), HYBRID, HandoffSettings())
    assert not choice.handoff and choice.reason is HandoffReason.SHORT_PROMPT


def test_mostly_cached_prompt_stays_colocated():
    choice = choose_handoff(request(cached_tokens=7500), HYBRID, HandoffSettings())
    assert choice.reason is HandoffReason.SHORT_PROMPT


def test_idle_decode_worker_keeps_the_prefill():
    choice = choose_handoff(request(num_decoding=0), HYBRID, HandoffSettings())
    assert choice.reason is HandoffReason.IDLE_DECODE


def test_backed_up_prefill_workers_keep_the_prompt_colocated():
    settings = HandoffSettings(max_prefill_wait_seconds=2.0)
    busy = choose_handoff(request(prefill_wait_seconds=2.5), HYBRID, settings)
    assert busy.reason is HandoffReason.PREFILL_BUSY
    assert choose_handoff(request(prefill_wait_seconds=1.5), HYBRID, settings).handoff


def test_a_transfer_longer_than_its_bound_does_not_pay():
    settings = HandoffSettings(max_transfer_seconds=0.01)  # 8k tokens take 23 ms here
    assert choose_handoff(request(), HYBRID, settings).reason is HandoffReason.SLOW_TRANSFER
    assert choose_handoff(request(prompt_tokens=1100), HYBRID, settings).handoff  # 9.3 ms


def test_unknown_rate_never_hands_off():
    choice = choose_handoff(request(transfer_bytes_per_second=0), HYBRID, HandoffSettings())
    assert choice.reason is HandoffReason.NO_RATE and choice.transfer_seconds == float("inf")


def test_slow_link_does_not_pay():
    slow = request(transfer_bytes_per_second=1e6, num_decoding=1)
    assert choose_handoff(slow, HYBRID, HandoffSettings()).reason is HandoffReason.SLOW_TRANSFER


def test_hybrid_handoff_has_a_constant_gdn_part_and_fewer_bytes():
    constant = HYBRID.handoff_bytes(0)
    assert constant == 36 * HYBRID.gdn_state_bytes
    assert HYBRID.handoff_bytes(2000) - constant == 12 * 2000 * 2048
    assert HYBRID.handoff_bytes(8000) < ATTENTION_ONLY.handoff_bytes(8000)
    assert HYBRID.gdn_share(100) > HYBRID.gdn_share(8000) > 0
    assert ATTENTION_ONLY.gdn_share(8000) == 0


def test_hybrid_pays_where_attention_only_does_not_on_a_slow_link():
    slow = request(transfer_bytes_per_second=0.2 * GB, num_decoding=2, prefill_seconds=2.0)
    assert choose_handoff(slow, HYBRID, HandoffSettings()).handoff
    assert not choose_handoff(slow, ATTENTION_ONLY, HandoffSettings()).handoff


def test_settings_refuse_nonsense():
    with pytest.raises(ValueError):
        HandoffSettings(max_transfer_share=0)
    with pytest.raises(ValueError):
        HandoffSettings(latency_seconds=-1)


def load(worker_id, role, num_decoding=0, free=1000, draining=False) -> WorkerLoad:
    return WorkerLoad(worker_id, role, num_decoding, free, 16, draining=draining)


def test_decode_goes_to_the_least_busy_decode_capable_worker_with_room():
    workers = [
        load("p0", WorkerRole.PREFILL),
        load("d0", WorkerRole.DECODE, num_decoding=5),
        load("d1", WorkerRole.DECODE, num_decoding=2, free=10),  # no room for 8k tokens
        load("b0", WorkerRole.BOTH, num_decoding=3),
        load("d2", WorkerRole.DECODE, num_decoding=0, draining=True),
    ]
    assert pick_decode_worker(workers, 8000).worker_id == "b0"
    assert pick_decode_worker(workers, 100).worker_id == "d1"
    assert pick_decode_worker(workers[:1], 100) is None


def test_prompt_goes_to_a_prefill_only_worker_or_none():
    workers = [load("p0", WorkerRole.PREFILL, 3), load("p1", WorkerRole.PREFILL, 1)]
    assert pick_prefill_worker(workers).worker_id == "p1"
    assert pick_prefill_worker([load("b0", WorkerRole.BOTH)]) is None


def test_roles_say_what_they_run():
    assert WorkerRole.BOTH.prefills and WorkerRole.BOTH.decodes
    assert WorkerRole.PREFILL.prefills and not WorkerRole.PREFILL.decodes
    assert WorkerRole.DECODE.decodes and not WorkerRole.DECODE.prefills
