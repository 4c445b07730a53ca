"""The cost models' interpolation: exact on grid points, monotone, never negative."""

from __future__ import annotations

import itertools
import random

import pytest

from common.interp import MonotoneCurve, MonotoneGrid, isotonic


def test_isotonic_pools_adjacent_violators_into_their_mean():
    assert isotonic([1, 3, 2, 4]) == [1, 2.5, 2.5, 4]
    assert isotonic([1, 2, 3]) == [1, 2, 3]
    assert isotonic([3, 2, 1]) == [2, 2, 2]


def test_grid_is_exact_on_grid_points_of_monotone_data():
    axes = [[0, 16, 64, 256], [0, 1, 4], [0, 512, 2048]]
    values = {
        idx: 0.001 * (1 + idx[0] * 3 + idx[1] * 2 + idx[2] + idx[0] * idx[2])
        for idx in itertools.product(range(4), range(3), range(3))
    }
    grid = MonotoneGrid(axes, values)
    for idx, value in values.items():
        point = [axes[k][i] for k, i in enumerate(idx)]
        assert grid(*point) == pytest.approx(value, rel=1e-12)


def test_curve_is_exact_on_its_points_and_linear_between():
    curve = MonotoneCurve([1, 2, 4], [1.0, 2.0, 6.0])
    assert [curve(x) for x in (1, 2, 4)] == pytest.approx([1.0, 2.0, 6.0])
    assert curve(3) == pytest.approx(4.0)
    assert curve(1.5) == pytest.approx(1.5)


def test_beyond_the_last_point_continues_with_the_last_slope_and_before_the_first_is_constant():
    curve = MonotoneCurve([10, 20], [1.0, 3.0])
    assert curve(30) == pytest.approx(5.0)
    assert curve(1000) == pytest.approx(199.0)
    assert curve(0) == pytest.approx(1.0)
    assert curve(-50) == pytest.approx(1.0)


def test_noisy_measurements_become_monotone_along_every_axis_and_never_negative():
    rng = random.Random(7)
    axes = [[0, 32, 128, 512], [0, 2, 8, 32], [0, 256, 1024]]
    values = {
        idx: rng.uniform(-0.01, 0.05) + 0.01 * sum(idx)
        for idx in itertools.product(range(4), range(4), range(3))
    }
    grid = MonotoneGrid(axes, values)
    samples = [-10, 0, 1, 17, 40, 128, 300, 512, 700, 5000]
    for x, y, z in itertools.product(samples, samples[:8], samples[:9]):
        f = grid(x, y, z)
        assert f >= 0.0
        for dx, dy, dz in ((13, 0, 0), (0, 3, 0), (0, 0, 200)):
            assert grid(x + dx, y + dy, z + dz) >= f - 1e-12, (x, y, z, dx, dy, dz)


def test_a_decreasing_measurement_is_smoothed_to_the_mean_not_kept():
    curve = MonotoneCurve([0, 1, 2], [1.0, 3.0, 2.0])
    assert curve.values() == pytest.approx([1.0, 2.5, 2.5])


def test_repeated_x_values_are_averaged():
    curve = MonotoneCurve([1, 1, 2], [1.0, 3.0, 4.0])
    assert curve(1) == pytest.approx(2.0)


def test_an_axis_must_be_strictly_increasing():
    with pytest.raises(ValueError, match="strictly increasing"):
        MonotoneGrid([[0, 2, 1]], [1, 2, 3])


def test_a_single_point_axis_is_constant_along_it():
    grid = MonotoneGrid([[5], [0, 10]], [[1.0, 2.0]])
    assert grid(0, 5) == pytest.approx(1.5)
    assert grid(100, 5) == pytest.approx(1.5)
