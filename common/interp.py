"""Monotone piecewise-linear interpolation of measured costs (step and operator times).

A cost measured on a rectilinear grid (one or more axes, e.g. tokens x context length)
becomes a function defined everywhere that a simulator can trust:
- never negative;
- non-decreasing along every axis (more work never costs less), even where the
  measurements are noisy: each line of the grid is first replaced by its closest
  non-decreasing fit (least squares, pool-adjacent-violators), then a running maximum
  along every axis removes what the per-line fits left;
- equal to the measurements on grid points whenever those were already non-decreasing;
- multilinear between grid points, constant below an axis' first point, and linear beyond
  its last point with the last segment's slope (slopes made non-decreasing along the other
  axes, so that extrapolation keeps the ordering too).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Sequence

Index = tuple[int, ...]


def isotonic(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in least squares."""
    blocks: list[tuple[float, int]] = []  # (mean, count)
    for value in values:
        mean, count = float(value), 1
        while blocks and blocks[-1][0] > mean:
            prev_mean, prev_count = blocks.pop()
            mean = (prev_mean * prev_count + mean * count) / (prev_count + count)
            count += prev_count
        blocks.append((mean, count))
    return [mean for mean, count in blocks for _ in range(count)]


def running_max(values: Sequence[float]) -> list[float]:
    return list(itertools.accumulate(values, max))


class MonotoneGrid:
    """f(x_0, ..., x_{n-1}) from values measured on the grid axes[0] x ... x axes[n-1].

    `values` maps each grid index (i_0, ..., i_{n-1}) to its value, or is nested lists
    indexed [i_0][i_1]...; every grid point needs a value. Each axis must be strictly
    increasing; an axis may hold a single point (f is then constant along it).
    """

    def __init__(self, axes: Sequence[Sequence[float]], values) -> None:
        self.axes = [[float(x) for x in axis] for axis in axes]
        if not self.axes:
            raise ValueError("a grid needs at least one axis")
        for k, axis in enumerate(self.axes):
            if not axis:
                raise ValueError(f"axis {k} is empty")
            if any(b <= a for a, b in zip(axis, axis[1:])):
                raise ValueError(f"axis {k} must be strictly increasing, got {axis}")
        shape = tuple(len(axis) for axis in self.axes)
        grid = {idx: max(0.0, float(_lookup(values, idx))) for idx in _indices(shape)}
        for k in range(len(shape)):
            _apply_along(grid, shape, k, isotonic)
        for k in range(len(shape)):
            _apply_along(grid, shape, k, running_max)
        self.grid = dict(grid)  # the monotone values on the measured points
        # One far point past the end of every axis turns extrapolation into interpolation.
        for k in range(len(shape)):
            grid, shape = _extend(self.axes[k], grid, shape, k)
        self._axes = [axis + [axis[-1] + _far_offset(axis)] for axis in self.axes]
        self._shape = shape
        self._strides = _strides(shape)
        self._flat = [0.0] * math.prod(shape)
        for idx, value in grid.items():
            self._flat[sum(i * s for i, s in zip(idx, self._strides))] = value

    def __call__(self, *point: float) -> float:
        if len(point) != len(self._axes):
            raise ValueError(f"expected {len(self._axes)} coordinates, got {len(point)}")
        flat = self._flat
        if len(point) == 1:  # the hot paths of a simulation, unrolled
            i, t = _cell(self._axes[0], point[0])
            return max(0.0, flat[i] + t * (flat[i + 1] - flat[i]) if t else flat[i])
        if len(point) == 2:
            i, t = _cell(self._axes[0], point[0])
            j, u = _cell(self._axes[1], point[1])
            row, base = self._strides[0], i * self._strides[0] + j
            low = flat[base] + u * (flat[base + 1] - flat[base])
            high = flat[base + row] + u * (flat[base + row + 1] - flat[base + row])
            return max(0.0, low + t * (high - low))
        cells = [_cell(axis, float(x)) for axis, x in zip(self._axes, point)]
        total = 0.0
        for corner in itertools.product((0, 1), repeat=len(cells)):
            weight, index = 1.0, 0
            for (lo, t), bit, stride in zip(cells, corner, self._strides):
                weight *= t if bit else 1.0 - t
                index += (lo + bit) * stride
            if weight:
                total += weight * flat[index]
        return max(0.0, total)


class MonotoneCurve:
    """A one-axis MonotoneGrid from (x, y) points; repeated x values are averaged."""

    def __init__(self, xs: Sequence[float], ys: Sequence[float]) -> None:
        if len(xs) != len(ys) or not xs:
            raise ValueError("a curve needs as many y values as x values, at least one")
        sums: dict[float, list[float]] = {}
        for x, y in zip(xs, ys):
            sums.setdefault(float(x), []).append(float(y))
        self.xs = sorted(sums)
        self._grid = MonotoneGrid([self.xs], [sum(sums[x]) / len(sums[x]) for x in self.xs])

    def __call__(self, x: float) -> float:
        return self._grid(x)

    def values(self) -> list[float]:
        """The monotone values at self.xs."""
        return [self._grid.grid[(i,)] for i in range(len(self.xs))]


def _lookup(values, idx: Index) -> float:
    if isinstance(values, dict):
        return values[idx]
    for i in idx:
        values = values[i]
    return values


def _indices(shape: Sequence[int]):
    return itertools.product(*(range(n) for n in shape))


def _strides(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return strides[::-1]


def _lines(shape: Sequence[int], k: int):
    """The first index of every line along axis k."""
    return _indices([n if j != k else 1 for j, n in enumerate(shape)])


def _at(start: Index, k: int, i: int) -> Index:
    return start[:k] + (i,) + start[k + 1 :]


def _apply_along(
    grid: dict[Index, float], shape: Sequence[int], k: int, fn: Callable[[list[float]], list[float]]
) -> None:
    for start in _lines(shape, k):
        line = fn([grid[_at(start, k, i)] for i in range(shape[k])])
        for i, value in enumerate(line):
            grid[_at(start, k, i)] = value


def _far_offset(axis: list[float]) -> float:
    return max(axis[-1] - axis[0], 1.0) * 1e6


def _extend(
    axis: list[float], grid: dict[Index, float], shape: tuple[int, ...], k: int
) -> tuple[dict[Index, float], tuple[int, ...]]:
    """Add the far point of axis k: each line continues with its last segment's slope,
    the slopes made non-decreasing along the other axes first."""
    n = shape[k]
    slopes = {}
    for start in _lines(shape, k):
        if n == 1:
            slopes[start] = 0.0
            continue
        last, prev = grid[_at(start, k, n - 1)], grid[_at(start, k, n - 2)]
        slopes[start] = max(0.0, (last - prev) / (axis[-1] - axis[-2]))
    flat_shape = tuple(m if j != k else 1 for j, m in enumerate(shape))
    for j in range(len(shape)):
        if j != k:
            _apply_along(slopes, flat_shape, j, running_max)
    extended = dict(grid)
    for start, slope in slopes.items():
        extended[_at(start, k, n)] = grid[_at(start, k, n - 1)] + _far_offset(axis) * slope
    return extended, tuple(m + 1 if j == k else m for j, m in enumerate(shape))


def _cell(axis: list[float], x: float) -> tuple[int, float]:
    """(index of the cell's lower point, position in it 0..1), clamped to the axis."""
    if len(axis) == 1 or x <= axis[0]:
        return 0, 0.0
    if x >= axis[-1]:
        return len(axis) - 2, 1.0
    hi = bisect.bisect_right(axis, x)
    lo = hi - 1
    return lo, (x - axis[lo]) / (axis[hi] - axis[lo])
