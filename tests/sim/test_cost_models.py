"""The cost models: the shipped A30 profile, a step table's round trip and mapping."""

from __future__ import annotations

import shutil
from importlib import resources

import pytest

from common import step_table
from common.step_table import StepLoad, StepTable, StepTableModel
from service.sim.costs import load_cost_source
from service.sim.vidur import ProfileError, VidurCostModel, read_shape


@pytest.fixture(scope="module")
def a30():
    return load_cost_source(profile="a30-qwen2-7b", step_table_path=None, page_size=16)


def test_the_shipped_profile_times_qwen2_7b_steps_on_an_a30(a30):
    model = a30.model
    one_decode = model.step_seconds(StepLoad((), (500,)))
    # 28 layers of weights (~15 GB in bf16) read once per step: 15-25 ms on an A30.
    assert 0.015 < one_decode < 0.025
    assert model.step_seconds(StepLoad(((4096, 0),), ())) > 20 * one_decode
    # Qwen2-7B: 7.6B parameters; an A30's 24 GiB leave room for about 100k tokens.
    assert a30.default_kv_pages * 16 == pytest.approx(100_000, rel=0.05)


def test_step_time_grows_with_every_kind_of_work(a30):
    model = a30.model
    base = StepLoad(((128, 256),), (1000,) * 8)
    more = [
        StepLoad(((256, 256),), (1000,) * 8),
        StepLoad(((128, 1024),), (1000,) * 8),
        StepLoad(((128, 256),), (1000,) * 16),
        StepLoad(((128, 256),), (3000,) * 8),
        StepLoad(((128, 256), (64, 0)), (1000,) * 8),
    ]
    for load in more:
        assert model.step_seconds(load) > model.step_seconds(base), load
    assert model.step_seconds(StepLoad()) == 0.0


def test_a_profile_measured_for_another_shape_is_refused(tmp_path):
    profile = tmp_path / "p"
    shutil.copytree(
        str(resources.files("service.sim") / "data" / "profiles" / "a30-qwen2-7b"), profile
    )
    toml = (profile / "model.toml").read_text().replace("hidden_size = 3584", "hidden_size = 4096")
    (profile / "model.toml").write_text(toml)
    with pytest.raises(ProfileError, match="n_embd 3584, but the model shape"):
        VidurCostModel(profile)


def test_a_shape_can_come_from_an_hf_config_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(
        '{"num_hidden_layers": 28, "hidden_size": 3584, "num_attention_heads": 28,'
        ' "num_key_value_heads": 4, "intermediate_size": 18944,'
        ' "vocab_size": 152064, "model_type": "qwen2"}'
    )
    shape = read_shape(path)
    assert shape.num_layers == 28 and shape.kv_bytes_per_token() == 2 * 28 * 4 * 128 * 2


def table() -> StepTable:
    seconds = tuple(
        tuple(
            tuple(
                0.001 * (1 + p / 16 + d + c / 512 + p * c / 8192) if p or d else 0.0
                for c in (0, 512, 2048)
            )
            for d in (0, 1, 8)
        )
        for p in (0, 64, 512)
    )
    return StepTable(
        (0, 64, 512),
        (0, 1, 8),
        (0, 512, 2048),
        seconds,
        0.002,
        {"page_size": 16, "total_kv_pages": 1000, "total_gdn_slots": 8},
    )


def test_a_step_table_round_trips_through_its_file(tmp_path):
    path = tmp_path / "t.json"
    step_table.save(table(), path)
    assert step_table.load(path) == table()


def test_a_step_table_is_exact_on_its_grid_and_adds_the_extra_chunk_cost():
    model = StepTableModel(table())
    t = table()
    assert model.step_seconds(StepLoad(((64, 512),), (512,))) == pytest.approx(t.seconds[1][1][1])
    assert model.step_seconds(StepLoad((), (2048,) * 8)) == pytest.approx(t.seconds[0][2][2])
    two = model.step_seconds(StepLoad(((32, 512), (32, 512)), (512,)))
    assert two == pytest.approx(t.seconds[1][1][1] + 0.002)
    assert model.step_seconds(StepLoad()) == 0.0


def test_a_step_table_sizes_the_simulated_workers_like_the_profiled_engine(tmp_path):
    path = tmp_path / "t.json"
    step_table.save(table(), path)
    source = load_cost_source(profile=None, step_table_path=str(path), page_size=32)
    assert source.default_kv_pages == 500 and source.default_gdn_slots == 8


def test_a_file_that_is_not_a_step_table_is_refused(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{"format": "something else"}')
    with pytest.raises(ProfileError, match="not a step table"):
        load_cost_source(profile=None, step_table_path=str(path), page_size=16)
