"""lattice-worker's prefix-cache flags: bad values are one line naming the flag, and the
engine built gets what was asked."""
import argparse

import pytest

from worker_client import cli


@pytest.mark.parametrize("argv, words", [
    (["--cache-block-tokens", "20", "--page-size", "16"], "--cache-block-tokens must be a multiple of --page-size (16), got 20"),
    (["--cache-block-tokens", "0"], "--cache-block-tokens must be at least 1"),
    (["--snapshot-slots", "-1"], "--snapshot-slots must not be negative"),
    (["--prefix-cache-blocks", "-2"], "--prefix-cache-blocks must not be negative"),
])
def test_a_bad_cache_flag_is_one_line_naming_it(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--worker-id", "w", "--model", "scripted", *argv])
    assert exit_info.value.code == 2
    assert words in capsys.readouterr().err


def _args(**overrides) -> argparse.Namespace:
    values = dict(model="scripted", kv_pages=64, page_size=4, gdn_slots=4, step_ms=None,
                  cache_block_tokens=None, snapshot_slots=None, prefix_cache_blocks=None,
                  no_prefix_cache=False)
    return argparse.Namespace(**{**values, **overrides})


def test_the_scripted_worker_keeps_a_cache_only_when_asked():
    assert cli._build_engine(_args()).cache_block_tokens == 0
    engine = cli._build_engine(_args(cache_block_tokens=8, snapshot_slots=5))
    assert (engine.cache_block_tokens, engine.total_snapshot_slots) == (8, 5)
    assert cli._build_engine(_args(cache_block_tokens=8, no_prefix_cache=True)).cache_block_tokens == 0


def test_the_model_worker_caches_by_default_and_not_with_no_prefix_cache():
    pytest.importorskip("torch")
    common = dict(model="tiny", device="cpu", dtype="float32", seed=0, threads=None, worker_id="w")
    engine = cli._build_engine(_args(**common))
    assert engine.cache_block_tokens == 16 and engine.total_snapshot_slots > 0  # 4 pages of 4
    off = cli._build_engine(_args(**common, no_prefix_cache=True))
    assert (off.cache_block_tokens, off.total_snapshot_slots) == (0, 0)
