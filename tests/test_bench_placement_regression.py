"""bench/placement_regression.py resumes from its cache: a run kept under --cache is read
back, not run again; a capacity search whose probes are all kept is answered from them;
with --from-cache a run that is not kept is left out of the table, never run. No
simulation runs here (the runner's simulation is replaced by one that fails)."""

from __future__ import annotations

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
