"""`lattice-worker profile`: time the reference engine's steps for the simulator.

Each measured step is what `ModelEngine.step` runs for a worker: one prefill chunk of P
tokens whose first C prompt tokens are cached, plus D decodes of sequences holding C
tokens each (common/step_table.py has the grid's semantics). The cached tokens are
reserved without being computed (their values do not change a step's time), so a grid
reaching long contexts takes minutes, not hours, on a CPU.

After the grid, `extra_chunk_seconds` is measured (a step of 4 chunks against one chunk
of the same total), then held-out steps off the grid (other sizes, several chunks, mixed
contexts) are timed and compared with the table's prediction.
"""

from __future__ import annotations

import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import torch

from common.step_table import HeldOutPoint, StepLoad, StepTable, StepTableModel
from worker_client.engine.api import ChunkWork, SequenceSpec
from worker_client.engine.engine import ModelEngine

# Token id of every profiled prompt (ids do not change a step's time).
_TOKEN_ID = 3
# Never reached: profiled sequences do not finish on length.
_MAX_NEW_TOKENS = 1 << 20
_SPLIT_CHUNKS = 4


def next_prefill_chunks(
    specs: Sequence[SequenceSpec], num_scheduled: list[int], chunk_size: int
) -> list[ChunkWork]:
    """The next chunk (up to `chunk_size` tokens) of every prompt not yet handed to the
    engine, as a worker driven directly would get them; `num_scheduled[i]` (prompt tokens
    of specs[i] handed so far) moves on. The spec goes with a prompt's first chunk."""
    chunks = []
    for seq_id, spec in enumerate(specs):
        start = num_scheduled[seq_id]
        chunk_len = min(chunk_size, len(spec.prompt_token_ids) - start)
        if chunk_len > 0:
            chunks.append(ChunkWork(seq_id, start, chunk_len, spec if start == 0 else None))
            num_scheduled[seq_id] += chunk_len
    return chunks


@dataclass(frozen=True)
class Grid:
    """The step shapes to measure: every combination of the three axes."""

    prefill_tokens: tuple[int, ...]
    decode_batch: tuple[int, ...]
    context_len: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("prefill_tokens", "decode_batch", "context_len"):
            axis = getattr(self, name)
            if not axis or list(axis) != sorted(set(axis)) or axis[0] < 0:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be distinct non-negative "
                    f"increasing numbers, got {list(axis)}"
                )

    @property
    def max_sequences(self) -> int:
        return self.decode_batch[-1] + _SPLIT_CHUNKS

    @property
    def max_tokens_per_sequence(self) -> int:
        return self.context_len[-1] + self.prefill_tokens[-1] + 2


DEFAULT_GRIDS = {
    "cpu": Grid((0, 16, 64, 256, 512), (0, 1, 2, 4, 8), (0, 256, 1024, 2048)),
    "cuda": Grid(
        (0, 16, 64, 256, 512, 1024, 2048), (0, 1, 4, 16, 32, 64), (0, 512, 1024, 2048, 4096)
    ),
}


CLOCKS = ("auto", "wall", "cpu")


def pick_clock(clock: str, device: torch.device) -> str:
    """auto: the process's CPU time on a CPU with one torch thread (other processes on the
    machine then cannot inflate a step), wall time otherwise."""
    if clock != "auto":
        return clock
    return "cpu" if device.type == "cpu" and torch.get_num_threads() == 1 else "wall"


class StepTimer:
    """Times ModelEngine steps of a given shape from freshly set-up sequences."""

    def __init__(self, engine: ModelEngine, repeats: int, clock: str = "wall") -> None:
        self.engine = engine
        self.repeats = repeats
        self._now = time.process_time if clock == "cpu" else time.perf_counter
        self._next_seq_id = 1

    def seconds(self, load: StepLoad) -> float:
        """The shortest wall time of `repeats` steps doing `load` (the best of, as the
        project's benchmarks take it: other work on the machine only ever adds time)."""
        times = []
        for _ in range(self.repeats):
            chunks, decodes = self._set_up(load)
            self._sync()
            started = self._now()
            self.engine.step(chunks, decodes)
            self._sync()
            times.append(self._now() - started)
            self.engine.evict(self.engine.waiting_ids() + self.engine.running_ids())
        return min(times)

    def _set_up(self, load: StepLoad) -> tuple[list[ChunkWork], list[int]]:
        chunks = []
        for num_tokens, num_cached in load.prefill_chunks:
            seq_id = self._prime(num_cached + num_tokens, num_cached, running=False)
            chunks.append(ChunkWork(seq_id, num_cached, num_tokens, None))
        decodes = [self._prime(c, c, running=True) for c in load.decode_context_lens]
        return chunks, decodes

    def _prime(self, prompt_len: int, num_cached: int, *, running: bool) -> int:
        """Admit a sequence of prompt_len tokens whose first num_cached are cached.

        Reaches into ModelEngine's books (its KV cache and held sequences) to reserve the
        cached positions without computing them: the profiler's one shortcut.
        """
        seq_id, self._next_seq_id = self._next_seq_id, self._next_seq_id + 1
        prompt_len = max(prompt_len, 1)
        spec = SequenceSpec(
            prompt_token_ids=(_TOKEN_ID,) * prompt_len, max_new_tokens=_MAX_NEW_TOKENS
        )
        self.engine.step([ChunkWork(seq_id, 0, 0, spec)], [])  # takes a slot, computes nothing
        held = self.engine._held[seq_id]
        self.engine._pages.append(seq_id, num_cached)
        held.num_prefilled = num_cached
        if running:  # as if the last prefill chunk had just sampled its first token
            held.num_prefilled = prompt_len
            held.token_ids.append(_TOKEN_ID)
            held.num_generated = 1
        return seq_id

    def _sync(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)


def measure_table(
    engine: ModelEngine,
    grid: Grid,
    *,
    repeats: int,
    clock: str,
    meta: dict,
    on_point: Callable[[int, int], None] | None = None,
) -> StepTable:
    """Time every grid point (and extra_chunk_seconds); on_point(done, total) reports."""
    timer = StepTimer(engine, repeats, clock)
    _warm_up(timer, grid)
    total = len(grid.prefill_tokens) * len(grid.decode_batch) * len(grid.context_len)
    done = 0
    seconds = []
    for p in grid.prefill_tokens:
        plane = []
        for d in grid.decode_batch:
            row = []
            for c in grid.context_len:
                row.append(timer.seconds(_grid_load(p, d, c)) if p or d else 0.0)
                done += 1
                if on_point:
                    on_point(done, total)
            plane.append(tuple(row))
        seconds.append(tuple(plane))
    return StepTable(
        grid.prefill_tokens,
        grid.decode_batch,
        grid.context_len,
        tuple(seconds),
        _extra_chunk_seconds(timer, grid),
        meta,
    )


def held_out_points(
    engine: ModelEngine,
    table: StepTable,
    grid: Grid,
    *,
    count: int,
    repeats: int,
    clock: str,
    seed: int,
) -> tuple[HeldOutPoint, ...]:
    """`count` random steps off the grid, timed, with the table's prediction."""
    rng = random.Random(seed)
    timer = StepTimer(engine, repeats, clock)
    model = StepTableModel(table)
    points = []
    for load in _random_loads(rng, grid, count):
        points.append(HeldOutPoint(load, timer.seconds(load), model.step_seconds(load)))
    return tuple(points)


def machine_meta(
    model_name: str, device: torch.device, dtype: torch.dtype, repeats: int, clock: str
) -> dict:
    return {
        "model": model_name,
        "device": str(device),
        "device_name": (
            torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
        ),
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "clock": clock,
        "measured_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def _grid_load(prefill_tokens: int, decode_batch: int, context_len: int) -> StepLoad:
    chunks = ((prefill_tokens, context_len),) if prefill_tokens else ()
    return StepLoad(chunks, (context_len,) * decode_batch)


def _warm_up(timer: StepTimer, grid: Grid) -> None:
    for p in {grid.prefill_tokens[-1], 16}:
        timer.seconds(_grid_load(p, grid.decode_batch[-1], grid.context_len[0]))


def _extra_chunk_seconds(timer: StepTimer, grid: Grid) -> float:
    """Median over a few points of (time of 4 chunks - time of 1 chunk, same tokens) / 3."""
    extras = []
    for p in grid.prefill_tokens:
        if p < _SPLIT_CHUNKS * 4:
            continue
        for c in (grid.context_len[0], grid.context_len[len(grid.context_len) // 2]):
            one = timer.seconds(_grid_load(p, 0, c))
            part = p // _SPLIT_CHUNKS
            split = timer.seconds(StepLoad(((part, c),) * _SPLIT_CHUNKS, ()))
            extras.append((split - one) / (_SPLIT_CHUNKS - 1))
    return max(0.0, statistics.median(extras)) if extras else 0.0


def _random_loads(rng: random.Random, grid: Grid, count: int) -> list[StepLoad]:
    max_p, max_d, max_c = grid.prefill_tokens[-1], grid.decode_batch[-1], grid.context_len[-1]
    loads = []
    while len(loads) < count:
        num_chunks = rng.choice((0, 1, 1, 2, 3)) if max_p else 0
        chunks = tuple(
            (rng.randint(1, max(1, max_p // max(num_chunks, 1))), rng.randint(0, max_c))
            for _ in range(num_chunks)
        )
        num_decodes = rng.randint(0, max_d)
        center = rng.randint(1, max(1, max_c))
        decodes = tuple(
            min(max_c, max(1, int(center * rng.uniform(0.5, 1.5)))) for _ in range(num_decodes)
        )
        if chunks or decodes:
            loads.append(StepLoad(chunks, decodes))
    return loads


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def format_held_out(points: Sequence[HeldOutPoint]) -> str:
    lines = ["chunks (tokens@cached)          decodes (mean ctx)  measured ms  predicted ms  error"]
    for p in points:
        chunks = " ".join(f"{n}@{c}" for n, c in p.load.prefill_chunks) or "-"
        mean_context = sum(p.load.decode_context_lens) / max(1, p.load.num_decodes)
        decodes = f"{p.load.num_decodes} ({mean_context:.0f})" if p.load.num_decodes else "-"
        lines.append(
            f"{chunks:<32}{decodes:>18}  {p.measured_seconds * 1000:>11.2f}  "
            f"{p.predicted_seconds * 1000:>12.2f}  {p.error * 100:>+5.0f}%"
        )
    return "\n".join(lines)


def progress_printer(prefix: str) -> Callable[[int, int], None]:
    started = time.perf_counter()

    def report(done: int, total: int) -> None:
        if done == total or done % max(1, total // 20) == 0:
            print(
                f"{prefix}: {done}/{total} grid points, {time.perf_counter() - started:.0f} s",
                file=sys.stderr,
                flush=True,
            )

    return report
