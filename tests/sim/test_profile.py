"""`lattice-worker profile` writes a step table that `simulate --step-table` reads."""

from __future__ import annotations

import json

import pytest

from common import step_table
from service.cli.main import main as scheduler_main
from worker_client.cli import main as worker_main


@pytest.mark.slow
def test_profile_writes_a_table_with_held_out_checks_that_simulate_reads(tmp_path, capsys):
    pytest.importorskip("torch")
    table_path = tmp_path / "tiny.json"
    code = worker_main(
        [
            "profile",
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--out",
            str(table_path),
            "--prefill-tokens",
            "0,16,64",
            "--decode-batch",
            "0,1,4",
            "--context-lens",
            "0,64",
            "--repeats",
            "2",
            "--held-out",
            "3",
            "--threads",
            "1",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "held-out accuracy over 3 steps" in out
    table = step_table.load(table_path)
    assert (table.prefill_tokens, table.decode_batch, table.context_len) == (
        (0, 16, 64),
        (0, 1, 4),
        (0, 64),
    )
    assert table.seconds[0][0] == (0.0, 0.0)
    assert all(v > 0 for plane in table.seconds[1:] for row in plane for v in row)
    assert len(table.held_out) == 3 and table.meta["clock"] == "cpu"
    assert table.meta["model"] == "tiny" and table.meta["total_gdn_slots"] >= 1

    json_path = tmp_path / "sim.json"
    assert (
        scheduler_main(
            [
                "simulate",
                "--step-table",
                str(table_path),
                "--qps",
                "20",
                "--num-requests",
                "20",
                "--workers",
                "2",
                "--max-seq-len",
                "512",
                "--no-progress",
                "--json",
                str(json_path),
            ]
        )
        == 0
    )
    (run,) = json.loads(json_path.read_text())
    assert run["num_requests"] == 20 and run["tpot_p50"] > 0


def test_profile_refuses_a_bad_grid_in_one_line(tmp_path, capsys):
    code = worker_main(
        ["profile", "--model", "tiny", "--out", str(tmp_path / "t.json"), "--decode-batch", "4,1"]
    )
    assert code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "--decode-batch must be distinct non-negative increasing" in err[0]
