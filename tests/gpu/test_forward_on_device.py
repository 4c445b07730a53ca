"""The reference engine on the device computes what it computes on the CPU.

Greedy generation through the engine (packed chunked prefill, batched decode) gives the
CPU's tokens in float32; teacher-forced logits through the paged path are as close to the
exact (float64) ones on the device as on the CPU, in float32 and in bfloat16 (the dtype a
CUDA worker serves in); a checkpoint written by transformers loads onto the device with
the CPU's weights.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import build_hf_checkpoint
from tests.engine.factories import FAMILY_PRESETS, make_engine, random_prompt
from worker_client.engine.api import SequenceSpec
from worker_client.engine.loading import load_model

from .device import (
    DEVICE,
    ON_DEVICE,
    assert_same_generation,
    generate,
    report,
    teacher_forced_logits,
)

pytestmark = ON_DEVICE

# Several rows of different lengths, one longer than a GDN chunk (64) and several prefill
# chunks (32), prefilled packed together and decoded in one batch.
PROMPT_LENGTHS = (3, 17, 70, 9, 150)
NUM_NEW = 16
# Teacher-forced logits against the exact ones (float64 arithmetic on the same weights):
# on the device at most SPREAD_FACTOR times further from them than on the CPU (the rule of
# tests/engine/tolerance.py, for two devices instead of two implementations). Float32: by
# the largest difference, and never past FLOAT32_MAX_RTOL of the logits' scale (measured
# on CPU: 3e-6; a GDN state off by 1% gives 5e-3). Bfloat16: by the root mean square (its
# rounding alone gives 2% on the dense model, 14% on the MoE ones, where it flips routing
# choices), so only gross errors (a wrong page, slot or state) stand out.
SPREAD_FACTOR = 4.0
FLOAT32_MAX_RTOL = 1e-3


def _specs(vocab_size: int) -> dict[int, SequenceSpec]:
    return {
        seq_id: SequenceSpec(
            random_prompt(length, seed=20 + seq_id, vocab_size=vocab_size),
            max_new_tokens=NUM_NEW,
            ignore_eos=True,
            logprobs=2,
        )
        for seq_id, length in enumerate(PROMPT_LENGTHS, start=1)
    }


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_greedy_generation_on_the_device_matches_the_cpu_in_float32(preset):
    cpu_model = load_model(preset, device="cpu", dtype=torch.float32)
    device_model = load_model(preset, device=DEVICE, dtype=torch.float32)
    assert device_model.device.type == DEVICE.type
    specs = _specs(cpu_model.config.vocab_size)
    on_cpu = generate(make_engine(cpu_model, total_kv_pages=256), specs)
    engine = make_engine(device_model, total_kv_pages=256, device=DEVICE)
    assert engine._pages.keys.device.type == DEVICE.type
    on_device = generate(engine, specs)
    largest = assert_same_generation(on_cpu, on_device)
    report(f"{preset} float32 greedy generation: log-probabilities within {largest:.2e} of the CPU")


def _teacher_forced(preset: str, dtype: torch.dtype, device, exact: bool = False):
    """Teacher-forced logits of the preset in `dtype` on `device`; `exact`: the same
    weights (rounded to `dtype`) computed in float64 on the CPU."""
    model = load_model(preset, device=device, dtype=dtype)
    if exact:
        model = model.to(device="cpu", dtype=torch.float64)
    tokens = random_prompt(90, seed=31, vocab_size=model.config.vocab_size)
    # 70 prompt tokens in chunks of 32 (the second and third read the first's pages and
    # GDN state), then 20 decode steps.
    return teacher_forced_logits(model, tokens, prompt_len=70, chunk_len=32)


def _rms(t: torch.Tensor) -> float:
    return float(t.pow(2).mean().sqrt())


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_float32_logits_on_the_device_are_as_close_to_float64_as_on_the_cpu(preset):
    exact = _teacher_forced(preset, torch.float32, "cpu", exact=True)
    scale = float(exact.abs().max())
    cpu_error = float((_teacher_forced(preset, torch.float32, "cpu") - exact).abs().max())
    device_error = float((_teacher_forced(preset, torch.float32, DEVICE) - exact).abs().max())
    report(
        f"{preset} float32: logits {device_error / scale:.2e} of their scale {scale:.2f} "
        f"from float64 at most (the CPU: {cpu_error / scale:.2e})"
    )
    assert device_error <= FLOAT32_MAX_RTOL * scale, (
        f"float32 logits on {DEVICE} are {device_error:.3e} from the float64 ones, more than "
        f"{FLOAT32_MAX_RTOL} of their scale {scale:.3f}"
    )
    # Or within 1e-5 of the scale: rounding a few ulps apart on another device's kernels.
    assert device_error <= max(SPREAD_FACTOR * cpu_error, 1e-5 * scale), (
        f"float32 logits on {DEVICE} are {device_error:.3e} from the float64 ones, more than "
        f"{SPREAD_FACTOR} x the CPU's {cpu_error:.3e}"
    )


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_bfloat16_logits_on_the_device_are_as_close_to_float64_as_on_the_cpu(preset):
    exact = _teacher_forced(preset, torch.bfloat16, "cpu", exact=True)
    scale = _rms(exact)
    cpu_error = _rms(_teacher_forced(preset, torch.bfloat16, "cpu") - exact) / scale
    device_error = _rms(_teacher_forced(preset, torch.bfloat16, DEVICE) - exact) / scale
    report(
        f"{preset} bfloat16: logits {device_error:.2e} from float64 (root mean square, "
        f"relative; the CPU: {cpu_error:.2e})"
    )
    assert cpu_error > 0
    assert device_error <= SPREAD_FACTOR * cpu_error, (
        f"bfloat16 logits on {DEVICE} are {device_error:.3e} from the float64 ones (root mean "
        f"square, relative), more than {SPREAD_FACTOR} x the CPU's {cpu_error:.3e}"
    )


def test_a_transformers_checkpoint_loads_onto_the_device_as_onto_the_cpu(tmp_path):
    checkpoint = build_hf_checkpoint(tmp_path / "qwen35_tiny")
    for dtype in (torch.float32, torch.bfloat16):
        on_cpu = load_model(checkpoint.path, device="cpu", dtype=dtype)
        on_device = load_model(checkpoint.path, device=DEVICE, dtype=dtype)
        cpu_tensors = on_cpu.state_dict()
        device_tensors = on_device.state_dict()
        assert set(device_tensors) == set(cpu_tensors)
        for name, tensor in device_tensors.items():
            assert tensor.device.type == DEVICE.type and tensor.dtype == dtype, name
            assert torch.equal(tensor.cpu(), cpu_tensors[name]), f"{dtype} {name}"
    # And the loaded model computes there what it computes on the CPU.
    specs = _specs(on_cpu.config.vocab_size)
    cpu_model = load_model(checkpoint.path, device="cpu", dtype=torch.float32)
    device_model = load_model(checkpoint.path, device=DEVICE, dtype=torch.float32)
    expected = generate(make_engine(cpu_model, total_kv_pages=256), specs)
    actual = generate(make_engine(device_model, total_kv_pages=256, device=DEVICE), specs)
    assert_same_generation(expected, actual)


def test_attention_on_the_device_keeps_off_cudnns_kernel():
    """On an H200 (torch 2.11) SDPA chose cuDNN for the engine's masked attention, which
    prepared each new key length on the CPU, about 55 ms a call against under a
    millisecond of GPU work: a step of two decodes of the demo model took 50-70 ms. The
    engine's attention runs the other kernels (attention.CUDA_ATTENTION_BACKENDS), in
    prefill and in decode, with rows of two lengths."""
    from torch.profiler import ProfilerActivity, profile

    model = load_model("tiny", device=DEVICE, dtype=torch.bfloat16)
    engine = make_engine(model, total_kv_pages=64, page_size=16)
    specs = {
        seq_id: SequenceSpec(
            random_prompt(length, seed=seq_id, vocab_size=model.config.vocab_size),
            max_new_tokens=4,
            ignore_eos=True,
            logprobs=2,
        )
        for seq_id, length in ((1, 40), (2, 75))
    }
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE.type == "cuda" else [])
    with profile(activities=activities) as prof:
        generated = generate(engine, specs)
    assert {seq_id: len(tokens) for seq_id, tokens in generated.items()} == {1: 4, 2: 4}
    ops = {event.key for event in prof.key_averages()}
    attention = sorted(op for op in ops if "attention" in op)
    report(f"attention ops of a prefill and decodes: {attention}")
    kernels = [op for op in attention if any(k in op for k in ("flash", "efficient", "math"))]
    assert kernels, "no attention kernel was profiled: the check would pass vacuously"
    assert not [op for op in attention if "cudnn" in op]
