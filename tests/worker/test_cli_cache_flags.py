"""lattice-worker's prefix-cache flags: bad values are one line naming the flag, and the
engine built gets what was asked."""

import argparse

import pytest

from worker_client import cli


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["--cache-block-tokens", "20", "--page-size", "16"],
            "--cache-block-tokens must be a multiple of --page-size (16), got 20",
        ),
        (["--cache-block-tokens", "0"], "--cache-block-tokens must be at least 1"),
        (["--snapshot-slots", "-1"], "--snapshot-slots must not be negative"),
        (["--prefix-cache-blocks", "-2"], "--prefix-cache-blocks must not be negative"),
    ],
)
def test_a_bad_cache_flag_is_one_line_naming_it(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--worker-id", "w", "--model", "scripted", *argv])
    assert exit_info.value.code == 2
    assert words in capsys.readouterr().err


def _args(**overrides) -> argparse.Namespace:
    values = dict(
        model="scripted",
        kv_pages=64,
        page_size=4,
        gdn_slots=4,
        step_ms=None,
        cache_block_tokens=None,
        snapshot_slots=None,
        prefix_cache_blocks=None,
        no_prefix_cache=False,
    )
    return argparse.Namespace(**{**values, **overrides})


def test_the_scripted_worker_keeps_a_cache_only_when_asked():
    assert cli._build_engine(_args()).cache_block_tokens == 0
    engine = cli._build_engine(_args(cache_block_tokens=8, snapshot_slots=5))
    assert (engine.cache_block_tokens, engine.total_snapshot_slots) == (8, 5)
    assert (
        cli._build_engine(_args(cache_block_tokens=8, no_prefix_cache=True)).cache_block_tokens == 0
    )


def test_the_model_worker_caches_by_default_and_not_with_no_prefix_cache():
    pytest.importorskip("torch")
    common = dict(model="tiny", device="cpu", dtype="float32", seed=0, threads=None, worker_id="w")
    engine = cli._build_engine(_args(**common))
    assert engine.cache_block_tokens == 16 and engine.total_snapshot_slots > 0  # 4 pages of 4
    off = cli._build_engine(_args(**common, no_prefix_cache=True))
    assert (off.cache_block_tokens, off.total_snapshot_slots) == (0, 0)


def test_the_prefix_cache_counts_resumes_misses_and_evictions_for_its_stats_line():
    from worker_client.engine.api import ChunkWork, SequenceSpec
    from worker_client.testing import ScriptedEngine

    engine = ScriptedEngine(total_kv_pages=16, page_size=4, total_gdn_slots=4, cache_block_tokens=4)
    prompt = tuple(range(2, 14))  # 3 blocks of 4
    first = SequenceSpec(prompt_token_ids=prompt, max_new_tokens=1)
    engine.step([ChunkWork(1, 0, 8, first)], [])  # ends on the block at 8: a snapshot
    engine.step([ChunkWork(1, 8, 4, None)], [])  # and at 12
    for _ in range(3):
        out = engine.step([], engine.running_ids())
        if out.finished:
            break
    cache = engine.prefix_cache
    second = SequenceSpec(prompt_token_ids=prompt + (20,), max_new_tokens=1)
    engine.step([ChunkWork(2, 8, 5, second, cached_tokens=8)], engine.running_ids())
    gone = SequenceSpec(prompt_token_ids=(99,) * 9, max_new_tokens=1)
    out = engine.step([ChunkWork(3, 4, 5, gone, cached_tokens=4)], engine.running_ids())
    assert out.cache_misses == (3,)
    assert (cache.num_resumes, cache.num_resumed_tokens, cache.num_resume_misses) == (1, 8, 1)
    assert "hit rate 50.0%" in cache.stats_line()
    while engine.running_ids():
        engine.step([], engine.running_ids())
    cached_blocks = cache.num_cached_blocks()
    cache.clear()
    assert cached_blocks > 0 and cache.num_evicted_blocks == cached_blocks
    assert f"{cached_blocks} blocks evicted" in cache.stats_line()
