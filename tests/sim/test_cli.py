"""`lattice-scheduler simulate` as outside tools call it: flags, JSON keys, determinism."""

from __future__ import annotations

import json

import pytest

from service.cli.main import main
from service.sim.metrics import JSON_KEYS

SMALL = [
    "--trace",
    "sharegpt",
    "--num-requests",
    "40",
    "--workers",
    "2",
    "--no-progress",
    "--policy",
    "fifo",
]


def simulate(tmp_path, *flags, name="out.json"):
    path = tmp_path / name
    assert main(["simulate", *SMALL, "--json", str(path), *flags]) == 0
    return json.loads(path.read_text())


def test_the_same_seed_writes_the_same_json(tmp_path):
    first = simulate(tmp_path, "--qps", "6", "--seed", "3", name="a.json")
    second = simulate(tmp_path, "--qps", "6", "--seed", "3", name="b.json")
    other = simulate(tmp_path, "--qps", "6", "--seed", "4", name="c.json")
    assert first == second
    assert first != other


def test_the_json_holds_one_object_per_run_with_exactly_the_issue_keys(tmp_path):
    runs = simulate(tmp_path, "--qps", "2,8")
    assert [tuple(run) for run in runs] == [JSON_KEYS, JSON_KEYS]
    assert [run["qps"] for run in runs] == [2.0, 8.0]
    assert all(
        run["policy"] == "fifo"
        and run["routing"] == "pull"
        and run["workers"] == 2
        and run["num_requests"] == 40
        for run in runs
    )


def test_the_terminal_table_shows_the_settings_and_the_figures(tmp_path, capsys):
    simulate(tmp_path, "--qps", "4", "--chunk-size", "256")
    out = capsys.readouterr().out
    settings = next(line for line in out.splitlines() if line.startswith("policy fifo:"))
    assert "chunk_size 256" in settings and "max_batch_size 32" in settings
    assert "TTFT p50 s" in out and "TPOT p50 ms" in out and "makespan s" in out


def test_policy_flags_reach_the_scheduler(tmp_path):
    default = simulate(tmp_path, "--qps", "8", name="a.json")[0]
    one_at_a_time = simulate(tmp_path, "--qps", "8", "--max-batch-size", "1", name="b.json")[0]
    assert one_at_a_time["ttft_p99"] > default["ttft_p99"]


def test_the_routing_baseline_runs_beside_pull(tmp_path):
    runs = [
        simulate(tmp_path, "--qps", "8", "--routing", routing, name=f"{routing}.json")[0]
        for routing in ("pull", "round-robin", "least-loaded")
    ]
    assert [run["routing"] for run in runs] == ["pull", "round-robin", "least-loaded"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--qps", "0"], "every QPS must be above 0"),
        ([], "give --qps"),
        (["--qps", "1", "--chunk-size", "0"], "chunk_size (--chunk-size) must be at least 1"),
        (["--qps", "1", "--policy", "nope"], "policy (--policy) must be one of"),
        (["--qps", "1", "--workers", "0"], "--workers must be at least 1"),
        (["--qps", "1", "--trace", "no-such-trace"], "neither a file nor a shipped trace"),
        (
            ["--qps", "1", "--profile", "no-such-profile"],
            "neither a directory nor a shipped profile",
        ),
        (["--qps", "1", "--find-capacity"], "needs --slo-ttft-p99"),
        (
            [
                "--find-capacity",
                "--slo-ttft-p99",
                "1",
                "--slo-tpot-p99",
                "1",
                "--capacity-tolerance",
                "0",
            ],
            "--capacity-tolerance must be between 0 and 1",
        ),
        (["--qps", "1", "--arrivals", "trace"], "has no arrived_at column"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(flags, message, capsys):
    try:
        code = main(["simulate", "--no-progress", *flags])
        from_argparse = False
    except SystemExit as exit_:  # argparse's own checks print the usage first
        code, from_argparse = exit_.code, True
    assert code == 2
    lines = capsys.readouterr().err.splitlines()
    assert message in lines[-1]
    assert from_argparse or len(lines) == 1


@pytest.mark.slow
def test_find_capacity_prints_its_steps_and_every_run_carries_the_capacity(tmp_path, capsys):
    runs = simulate(
        tmp_path, "--find-capacity", "--slo-ttft-p99", "0.3", "--slo-tpot-p99", "0.1", "--qps", "2"
    )
    out = capsys.readouterr().out
    assert "step 1: 2.000 QPS" in out and "capacity:" in out
    capacity = runs[0]["capacity_qps"]
    assert all(run["capacity_qps"] == capacity for run in runs)
    assert all(
        set(run) == {*JSON_KEYS, "capacity_qps", "saturation_requests_per_s"} for run in runs
    )
    meeting = [r for r in runs if r["ttft_p99"] <= 0.3 and r["tpot_p99"] <= 0.1]
    missing = [r for r in runs if r not in meeting]
    assert max(r["qps"] for r in meeting) == capacity
    assert missing and min(r["qps"] for r in missing) <= capacity * 1.05 + 1e-9


@pytest.mark.slow
def test_find_capacity_bisects_to_the_tolerance_given(tmp_path):
    runs = simulate(
        tmp_path,
        "--find-capacity",
        "--slo-ttft-p99",
        "0.3",
        "--slo-tpot-p99",
        "0.1",
        "--qps",
        "2",
        "--capacity-tolerance",
        "0.01",
    )
    capacity = runs[0]["capacity_qps"]
    missing = [r["qps"] for r in runs if not (r["ttft_p99"] <= 0.3 and r["tpot_p99"] <= 0.1)]
    assert capacity < min(missing) <= capacity * 1.01 + 1e-9


@pytest.mark.slow
def test_compare_runs_each_policy_and_plots_them(tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "cmp.png"
    runs = simulate(tmp_path, "--qps", "2,6", "--compare", "fifo,fifo", "--plot", str(plot))
    assert [(r["policy"], r["qps"]) for r in runs] == [("fifo", 2.0), ("fifo", 6.0)] * 2
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


MOONCAKE = [
    "--trace",
    "mooncake_conversation",
    "--block-tokens",
    "32",
    "--num-requests",
    "40",
    "--workers",
    "2",
    "--no-progress",
    "--policy",
    "fifo",
]


def simulate_mooncake(tmp_path, *flags, name="m.json"):
    path = tmp_path / name
    assert main(["simulate", *MOONCAKE, "--json", str(path), *flags]) == 0
    return json.loads(path.read_text())


@pytest.mark.parametrize("routing", ["pull", "kv-router", "prefix-load", "cache-aware"])
def test_a_mooncake_run_writes_the_cache_figures_and_the_bound(tmp_path, capsys, routing):
    (run,) = simulate_mooncake(tmp_path, "--qps", "2", "--routing", routing)
    assert tuple(run) == (
        *JSON_KEYS,
        "prefix_hit_rate_bound",
        "prefix_hit_rate_bound_workers_cache",
    )
    assert run["routing"] == routing
    assert run["computed_prefill_tokens"] > 0 and run["cache_misses"] >= 0
    assert 0 < run["prefix_hit_rate"] <= run["prefix_hit_rate_bound"] < 1
    assert 0 < run["prefix_hit_rate_bound_workers_cache"] <= run["prefix_hit_rate_bound"]
    assert sorted(run["worker_shares"]) == ["sim-0", "sim-1"]
    assert sum(run["worker_shares"].values()) == pytest.approx(1.0)
    assert run["max_share_over_mean"] == pytest.approx(max(run["worker_shares"].values()) * 2)
    out = capsys.readouterr().out
    assert "prefix hit rate bound:" in out and "with the workers' cache rule" in out
    assert "a prefix cache in blocks of 32 tokens" in out


def test_without_a_cache_nothing_is_resumed_and_no_bound_is_printed(tmp_path, capsys):
    (run,) = simulate_mooncake(tmp_path, "--qps", "2", "--cache-block-tokens", "0")
    assert run["prefix_hit_rate"] == 0 and run["cached_prefill_tokens"] == 0
    assert "prefix_hit_rate_bound" not in run
    assert "prefix_hit_rate_bound_workers_cache" not in run
    assert "bound" not in capsys.readouterr().out


def test_find_capacity_works_with_a_router_and_a_cache(tmp_path, capsys):
    runs = simulate_mooncake(
        tmp_path,
        "--find-capacity",
        "--slo-ttft-p99",
        "2",
        "--slo-tpot-p99",
        "0.1",
        "--qps",
        "4",
        "--routing",
        "kv-router",
    )
    assert runs and all(
        r["routing"] == "kv-router" and "capacity_qps" in r and "prefix_hit_rate_bound" in r
        for r in runs
    )
    assert "hit rate" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--qps", "1", "--trace", "mooncake_conversation", "--block-tokens", "0"],
            "--block-tokens must be at least 1",
        ),
        (
            ["--qps", "1", "--trace", "mooncake_conversation", "--block-tokens", "40"],
            "--cache-block-tokens must be a multiple of --page-size (16), got 40 (from --block-tokens",
        ),
        (["--qps", "1", "--cache-block-tokens", "-1"], "--cache-block-tokens must not be negative"),
        (["--qps", "1", "--gdn-snapshot-slots", "-2"], "--gdn-snapshot-slots must not be negative"),
    ],
)
def test_bad_cache_flags_are_one_line_and_exit_code_2(flags, message, capsys):
    assert main(["simulate", "--no-progress", *flags]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and message in lines[0]
