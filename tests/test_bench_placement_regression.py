"""bench/placement_regression.py resumes from its cache: a run kept under --cache is read
back, not run again; a capacity search whose probes are all kept is answered from them;
with --from-cache a run that is not kept is left out of the table, never run. No
simulation runs here (the runner's simulation is replaced by one that fails)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

import pytest

from bench import placement_regression as bench


class NoSimulation(bench.Runner):
    def _setup_and_config(self, routing, caching):
        raise AssertionError("a kept run was simulated again")


def keep(cache, name, routing, caching, qps, ttft=1.0, tpot=0.03):
    figures = bench.Figures(qps, ttft, tpot, 0.01, 1.05, 0.1, "abc1234")
    path = cache / f"{name}-n1000-s0-w4-{routing}-{caching}-{qps:.6g}.json"
    path.write_text(json.dumps(asdict(figures)))


def test_a_kept_run_is_read_back_and_a_missing_one_left_out_with_from_cache(tmp_path):
    setting = bench.SETTINGS[0]
    keep(tmp_path, setting.name, "pull", "on", 1.0, tpot=0.0297)
    runner = NoSimulation(setting, 1000, 0, 4, tmp_path, cached_only=True)
    cell = runner.run("1 QPS", 1.0, "pull", "on")
    assert (cell.tpot_p99, cell.commit) == (0.0297, "abc1234")
    assert runner.run("1 QPS", 1.0, "pull", "off") is None
    assert runner.capacity("off", 4.0, 0.2, log=lambda text: None) is None


def test_a_capacity_search_is_answered_from_its_kept_probes(tmp_path):
    setting = bench.SETTINGS[0]
    # 4 meets, 8 misses (TTFT over 2 s), the geometric middles 5.66 meets and 6.73
    # misses: within 20%, done.
    middle = (4.0 * 8.0) ** 0.5
    keep(tmp_path, setting.name, "pull", "off", 4.0)
    keep(tmp_path, setting.name, "pull", "off", 8.0, ttft=30.0)
    keep(tmp_path, setting.name, "pull", "off", middle)
    keep(tmp_path, setting.name, "pull", "off", (middle * 8.0) ** 0.5, ttft=3.0)
    runner = NoSimulation(setting, 1000, 0, 4, tmp_path)
    assert runner.capacity("off", 4.0, 0.2, log=lambda text: None) == pytest.approx(5.657, 1e-3)


def keep_run(cache, name, caching, seed, ttft, tpot):
    """A kept run at 1 QPS with its requests' latencies (sorted, as the runner keeps them)."""
    p99 = bench.percentile
    figures = bench.Figures(
        1.0, p99(ttft, 99), p99(tpot, 99), 0.01, 1.05, 0.1, "abc1234",
        ttft, tpot, [0.01] * len(ttft), 10, 90,
    )  # fmt: skip
    path = cache / f"{name}-n1000-s{seed}-w4-pull-{caching}-1.json"
    path.write_text(json.dumps(asdict(figures)))


def test_a_cell_at_several_seeds_takes_the_p99_of_all_their_requests(tmp_path):
    """Seed 0's two slow requests are its p99 but only 2 of the 300 pooled (below their
    p99): the cell reads 1.0 s, where the mean of the seeds' p99s would read 4.0 s.
    Seed 0's TPOT ratio (1.5x) is listed, the pooled one (1.0x) is on target."""
    setting = bench.SETTINGS[0]
    fast = [1.0] * 100
    keep_run(tmp_path, setting.name, "on", 0, [1.0] * 98 + [10.0, 10.0], [0.03] * 99 + [0.06])
    keep_run(tmp_path, setting.name, "off", 0, fast, [0.04] * 100)
    for seed in (1, 2):
        for caching in ("on", "off"):
            keep_run(tmp_path, setting.name, caching, seed, fast, [0.04] * 100)
    args = argparse.Namespace(
        cache=str(tmp_path), from_cache=True, num_requests=1000, workers=4, seeds=[0, 1, 2],
        routers=[], qps=[1.0], light_only=True,
    )  # fmt: skip
    cells, _ = bench.measure(setting, args)
    on = next(c for c in cells if c.caching == "on")
    assert (on.ttft_p99, on.tpot_p99, sorted(on.runs), on.pooled) == (1.0, 0.04, [0, 1, 2], True)
    assert on.runs[0].ttft_p99 == 10.0
    results = [(setting, cells, {"off": None, "on": None})]
    assert bench.misses(results) == []
    [line] = bench.seed_ratios(results)
    assert "TPOT 1.000 (s0 1.500, s1 1.000, s2 1.000)" in line
