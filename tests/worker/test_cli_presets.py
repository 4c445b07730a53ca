"""`lattice-worker --model small`: the benchmarks' seeded preset loads, generates, and
registers the handoff sizes of its own pools; vLLM refuses it like the tiny presets."""

import argparse

import pytest

from worker_client import cli


def _reference_args(model: str) -> argparse.Namespace:
    return argparse.Namespace(
        model=model,
        device="cpu",
        dtype="float32",
        seed=0,
        threads=None,
        worker_id="w",
        kv_pages=64,
        page_size=16,
        gdn_slots=2,
        step_ms=None,
        cache_block_tokens=None,
        snapshot_slots=None,
        prefix_cache_blocks=None,
        no_prefix_cache=False,
    )


def test_model_small_builds_the_small_config_and_generates():
    pytest.importorskip("torch")
    from worker_client.engine.api import ChunkWork, SequenceSpec
    from worker_client.engine.config import small_config

    engine = cli._build_engine(_reference_args("small"))
    assert engine.model.config == small_config()
    spec = SequenceSpec(prompt_token_ids=tuple(range(2, 42)), max_new_tokens=3, ignore_eos=True)
    tokens = []
    out = engine.step([ChunkWork(1, 0, 40, spec)], [])
    while True:
        tokens += [t for seq_id, ids in out.tokens if seq_id == 1 for t in ids]
        if any(f.seq_id == 1 for f in out.finished):
            break
        out = engine.step([], [1])
    assert len(tokens) == 3 and all(0 <= t < small_config().vocab_size for t in tokens)
    # What a prefill worker registers: 2 attention layers' K and V of 2 heads x 64 (fp32)
    # per token, and 6 GDN layers' recurrent and convolution states per sequence.
    assert engine.handoff_bytes_per_token == 2 * 2 * 2 * 64 * 4
    assert engine.handoff_fixed_bytes == 6 * (8 * 64 * 64 + 1024 * 3) * 4


def test_vllm_refuses_the_small_preset_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--worker-id", "w", "--model", "small", "--engine", "vllm"])
    assert exit_info.value.code == 2
    assert "runs a checkpoint directory, not --model small" in capsys.readouterr().err
