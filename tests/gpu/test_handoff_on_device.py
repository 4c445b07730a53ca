"""Handoffs on the device (docs/disaggregation.md): a sequence prefilled on one engine,
exported, imported into another and decoded there continues as if it had never moved.

Between two engines on the device the receiver does the sender's arithmetic, so the
generation is bitwise the uninterrupted one (float32 and bfloat16); between the device
and the CPU (float32) it is the CPU's within the tolerance of tests/gpu/device.py. The
exported state itself is the CPU's, byte layout and values.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.engine.factories import make_engine, random_prompt
from tests.engine.test_prefix_cache import BLOCK
from worker_client.engine.api import ChunkWork, SequenceSpec, StateKind
from worker_client.engine.handoff import from_bytes
from worker_client.engine.loading import load_model

from .device import (
    DEVICE,
    FLOAT32_LOGPROB_ATOL,
    ON_DEVICE,
    Generated,
    assert_bitwise_equal,
    assert_same_generation,
    generate,
    record,
    report,
)

pytestmark = ON_DEVICE

NUM_NEW = 16


def _spec(length: int, seed: int, vocab_size: int) -> SequenceSpec:
    return SequenceSpec(
        random_prompt(length, seed=seed, vocab_size=vocab_size),
        max_new_tokens=NUM_NEW,
        ignore_eos=True,
        logprobs=2,
    )


def _handed_off(
    sender, receiver, spec: SequenceSpec, *, first_token: int = 0
) -> dict[int, list[Generated]]:
    """Prefill `spec` on `sender` (its first token sampled there), export it from
    `first_token` on, import it into `receiver` (cached_tokens=first_token) and decode it
    there to the end: the generation, first token included."""
    outputs: dict[int, list[Generated]] = {}
    record(sender.step([ChunkWork(1, 0, len(spec.prompt_token_ids), spec)], []), outputs)
    (first,) = outputs[1]
    chunks = sender.export_sequence(1, first_token=first_token)
    assert chunks is not None
    receiver_spec = dataclasses.replace(
        spec,
        prompt_token_ids=(*spec.prompt_token_ids, first.token),
        max_new_tokens=spec.max_new_tokens - 1,
    )
    receiver.import_sequence(7, receiver_spec, chunks, cached_tokens=first_token)
    assert 7 in receiver.running_ids()
    decoded: dict[int, list[Generated]] = {}
    while 7 in receiver.running_ids():  # alone, whatever else the receiver holds
        record(receiver.step([], [7]), decoded)
    return {1: [first, *decoded[7]]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("preset", ["tiny", "tiny-next"])
def test_a_handoff_between_two_engines_on_the_device_continues_bitwise(preset, dtype):
    model = load_model(preset, device=DEVICE, dtype=dtype)
    spec = _spec(37, seed=3, vocab_size=model.config.vocab_size)
    uninterrupted = generate(make_engine(model), {1: spec}, chunk_len=37)
    sender, receiver = make_engine(model), make_engine(model)
    # The receiver holds another sequence throughout (not decoded with the handed-off
    # one): the import lands in other pages and another GDN slot than the sender's.
    other = _spec(21, seed=5, vocab_size=model.config.vocab_size)
    receiver.step([ChunkWork(9, 0, 21, other)], [])
    handed_off = _handed_off(sender, receiver, spec)
    # Still held, in the slot the sender's copy has: the import took another.
    assert receiver.running_ids() == [9]
    assert receiver._held[9].slot == sender._held[1].slot
    assert_bitwise_equal(uninterrupted, handed_off)
    assert sender.running_ids() == [1]  # the sender keeps its copy until evicted
    report(f"{preset} {dtype}: a handoff on the device continues bitwise")


@pytest.mark.parametrize(
    "sender_device,receiver_device", [(DEVICE, "cpu"), ("cpu", DEVICE)], ids=["to_cpu", "from_cpu"]
)
@pytest.mark.parametrize("preset", ["tiny", "tiny-next"])
def test_a_handoff_between_the_device_and_the_cpu_continues_with_the_cpus_tokens(
    preset, sender_device, receiver_device
):
    models = {
        device: load_model(preset, device=device, dtype=torch.float32)
        for device in {torch.device(sender_device), torch.device(receiver_device)}
    }
    cpu_model = load_model(preset, device="cpu", dtype=torch.float32)
    spec = _spec(45, seed=6, vocab_size=cpu_model.config.vocab_size)
    uninterrupted = generate(make_engine(cpu_model), {1: spec}, chunk_len=45)
    sender = make_engine(models[torch.device(sender_device)])
    receiver = make_engine(models[torch.device(receiver_device)])
    largest = assert_same_generation(uninterrupted, _handed_off(sender, receiver, spec))
    report(f"{preset} {sender_device} -> {receiver_device}: within {largest:.2e} of the CPU")


def test_a_receiver_on_the_device_resumes_its_cached_blocks_and_imports_the_rest():
    model = load_model("tiny", device=DEVICE, dtype=torch.float32)
    vocab = model.config.vocab_size
    shared = random_prompt(2 * BLOCK, seed=5, vocab_size=vocab)
    spec = _spec(13, seed=6, vocab_size=vocab)
    spec = dataclasses.replace(spec, prompt_token_ids=(*shared, *spec.prompt_token_ids))
    uninterrupted = generate(make_engine(model), {1: spec}, chunk_len=len(spec.prompt_token_ids))

    receiver = make_engine(model, cache_block_tokens=BLOCK, total_snapshot_slots=8)
    # Another sequence with the same first two blocks leaves them cached on the receiver.
    other = SequenceSpec((*shared, *random_prompt(5, seed=7, vocab_size=vocab)), 2, logprobs=2)
    generate(receiver, {2: other}, chunk_len=BLOCK)
    handed_off = _handed_off(make_engine(model), receiver, spec, first_token=2 * BLOCK)
    assert receiver.prefix_cache.num_resumes == 1
    assert_same_generation(uninterrupted, handed_off)


def test_the_device_exports_the_cpus_state():
    cpu_model = load_model("tiny-next", device="cpu", dtype=torch.float32)
    device_model = load_model("tiny-next", device=DEVICE, dtype=torch.float32)
    spec = _spec(40, seed=8, vocab_size=cpu_model.config.vocab_size)
    exports = []
    for model in (cpu_model, device_model):
        engine = make_engine(model)
        engine.step([ChunkWork(1, 0, 40, spec)], [])
        exports.append(engine.export_sequence(1, first_token=4))
    on_cpu, on_device = exports
    config = cpu_model.config
    assert [(c.kind, c.layer, c.first_token, c.num_tokens, len(c.data)) for c in on_device] == [
        (c.kind, c.layer, c.first_token, c.num_tokens, len(c.data)) for c in on_cpu
    ]
    kinds = [c.kind for c in on_cpu]
    assert kinds.count(StateKind.ATTENTION_KV) == config.num_full_attention_layers
    assert kinds.count(StateKind.GDN_RECURRENT) == config.num_linear_attention_layers
    largest = 0.0
    for cpu_chunk, device_chunk in zip(on_cpu, on_device):
        count = len(cpu_chunk.data) // 4
        expected = from_bytes(cpu_chunk.data, torch.float32, (count,))
        actual = from_bytes(device_chunk.data, torch.float32, (count,))
        scale = float(expected.abs().max())
        assert scale > 0, f"{cpu_chunk.kind} layer {cpu_chunk.layer}: an empty state"
        difference = float((actual - expected).abs().max())
        largest = max(largest, difference / scale)
        assert difference <= FLOAT32_LOGPROB_ATOL * scale, (
            f"{cpu_chunk.kind} layer {cpu_chunk.layer}: the device's state differs by "
            f"{difference:.3e}, {difference / scale:.2e} of its scale"
        )
    report(f"exported state within {largest:.2e} of the CPU's (relative to each chunk's scale)")
