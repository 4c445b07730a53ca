"""Step time from a Vidur operator profile (attention.csv + mlp.csv) and a model's shape.

Vidur (MLSys 2024) profiles each operator of a decoder layer on the GPU and composes a
batch's time from them. The same composition here, from the profile's median times:
- token-level operators (projections, MLP, norms, rope, residual add; `mlp.csv`; plus the
  KV-cache write of `attention.csv`) from the step's total tokens T = prefill + decodes;
- prefill attention from (cached tokens summed over the chunks, sqrt(sum of chunk
  lengths squared)): chunks of one step attend as one "equivalent" chunk;
- decode attention from (number of decodes, their mean cached tokens);
- step = layers x (per-layer sum) + embedding(T) + `step_overhead_ms` (0 unless the
  shape file sets it: the LM head, sampling and CPU overheads are not in these profiles).
Each operator's table is made monotone and interpolated (common.interp).
"""

from __future__ import annotations

import csv
import json
import math
import tomllib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from common.interp import MonotoneCurve, MonotoneGrid
from common.step_table import StepLoad

ATTENTION_CSV = "attention.csv"
MLP_CSV = "mlp.csv"
SHAPE_FILES = ("model.toml", "config.json")
# Token-level operators of one decoder layer in mlp.csv.
_LAYER_TOKEN_OPS = (
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)
_GIB = 1 << 30
# The reference engine's CUDA pool sizing (worker_client/engine/sizing.py): 90% of free
# memory minus 2 GiB for activations, at most 256 GDN slots.
_USABLE_FRACTION = 0.9
_RESERVED_BYTES = 2 * _GIB
_MAX_GDN_SLOTS = 256


class ProfileError(ValueError):
    """A profile directory or shape file that cannot be used; the message says why."""


@dataclass(frozen=True)
class ModelShape:
    """What the cost model and the pool defaults need to know about a model and device."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    head_dim: int = 0  # 0: hidden_size / num_attention_heads
    dtype_bytes: int = 2
    device: str = ""
    device_memory_gib: float = 0.0  # 0: unknown
    step_overhead_ms: float = 0.0

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def num_parameters(self) -> int:
        """Weights of a dense decoder (norms and biases left out: under 0.1%)."""
        q_dim = self.num_attention_heads * self.attention_head_dim
        kv_dim = self.num_key_value_heads * self.attention_head_dim
        per_layer = (
            self.hidden_size * (q_dim + 2 * kv_dim)
            + q_dim * self.hidden_size
            + 3 * self.hidden_size * self.intermediate_size
        )
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings

    def kv_bytes_per_token(self) -> int:
        return (
            2
            * self.num_layers
            * self.num_key_value_heads
            * self.attention_head_dim
            * self.dtype_bytes
        )

    def default_kv_pages(self, page_size: int) -> int | None:
        """KV pages that fit beside the weights on the device (the engine's CUDA rule);
        None when the device's memory is unknown."""
        if not self.device_memory_gib:
            return None
        budget = (
            self.device_memory_gib * _GIB * _USABLE_FRACTION
            - _RESERVED_BYTES
            - self.num_parameters() * self.dtype_bytes
        )
        pages = int(budget // (self.kv_bytes_per_token() * page_size))
        if pages < 1:
            raise ProfileError(
                f"{self.name} ({self.num_parameters() / 1e9:.1f}B parameters) "
                f"leaves no room for a KV cache in {self.device_memory_gib:g} "
                f"GiB; give --kv-pages"
            )
        return pages


def read_shape(path: Path) -> ModelShape:
    """A ModelShape from a small TOML (keys as ModelShape's fields) or an HF config.json."""
    try:
        if path.suffix == ".json":
            raw = json.loads(path.read_text())
            raw = raw.get("text_config", raw)
            fields = {
                "name": raw.get("_name_or_path") or raw.get("model_type", path.parent.name),
                "num_layers": raw["num_hidden_layers"],
                "hidden_size": raw["hidden_size"],
                "num_attention_heads": raw["num_attention_heads"],
                "num_key_value_heads": raw.get("num_key_value_heads", raw["num_attention_heads"]),
                "intermediate_size": raw["intermediate_size"],
                "vocab_size": raw["vocab_size"],
                "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
                "head_dim": raw.get("head_dim") or 0,
            }
        else:
            fields = tomllib.loads(path.read_text())
        known = set(ModelShape.__dataclass_fields__)
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ProfileError(
                f"{path}: unknown keys {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return ModelShape(**fields)
    except FileNotFoundError:
        raise ProfileError(f"{path}: no such file") from None
    except KeyError as missing:
        raise ProfileError(f"{path}: missing the key {missing}") from None
    except (TypeError, ValueError, tomllib.TOMLDecodeError) as err:
        if isinstance(err, ProfileError):
            raise
        raise ProfileError(f"{path}: {err}") from None


def find_shape_file(profile_dir: Path) -> Path:
    for name in SHAPE_FILES:
        if (profile_dir / name).is_file():
            return profile_dir / name
    raise ProfileError(
        f"{profile_dir}: no model shape ({' or '.join(SHAPE_FILES)}) beside the profile"
    )


class VidurCostModel:
    """Step time of a worker running `shape` on the device the profile was measured on."""

    def __init__(self, profile_dir: str | Path, shape: ModelShape | None = None) -> None:
        profile_dir = Path(profile_dir)
        if not profile_dir.is_dir():
            raise ProfileError(f"{profile_dir}: not a directory")
        self.shape = shape or read_shape(find_shape_file(profile_dir))
        mlp_rows = _read_rows(profile_dir / MLP_CSV)
        attention_rows = _read_rows(profile_dir / ATTENTION_CSV)
        _check_matches(self.shape, mlp_rows, attention_rows, profile_dir)
        self._tokens = self._token_curve(mlp_rows, attention_rows)
        prefill = [r for r in attention_rows if r["is_prefill"] == "True"]
        decode = [r for r in attention_rows if r["is_prefill"] != "True"]
        if not prefill or not decode:
            raise ProfileError(
                f"{profile_dir / ATTENTION_CSV}: needs both prefill and "
                f"decode rows (is_prefill True and False)"
            )
        self._prefill = _grid_from_rows(
            prefill, "prefill_chunk_size", "kv_cache_size", "attn_prefill"
        )
        self._decode = _grid_from_rows(decode, "batch_size", "kv_cache_size", "attn_decode")
        self._overhead_seconds = self.shape.step_overhead_ms / 1000.0

    def step_seconds(self, load: StepLoad) -> float:
        num_tokens = load.num_prefill_tokens + load.num_decodes
        if num_tokens == 0:
            return 0.0
        layer_ms = self._tokens(num_tokens)
        if load.prefill_chunks:
            cached = sum(c for _, c in load.prefill_chunks)
            equivalent_chunk = math.sqrt(sum(n * n for n, _ in load.prefill_chunks))
            layer_ms += self._prefill(equivalent_chunk, cached)
        if load.decode_context_lens:
            mean_cached = sum(load.decode_context_lens) / load.num_decodes
            layer_ms += self._decode(load.num_decodes, mean_cached)
        return layer_ms * self.shape.num_layers / 1000.0 + self._overhead_seconds

    def _token_curve(self, mlp_rows: list[dict], attention_rows: list[dict]) -> MonotoneCurve:
        """All token-level work of one layer, the embedding spread over the layers."""
        save_xs, save_ys = [], []
        for r in attention_rows:
            time = _median(r, "attn_kv_cache_save")
            if time is not None:
                tokens = r["prefill_chunk_size"] if r["is_prefill"] == "True" else r["batch_size"]
                save_xs.append(float(tokens))
                save_ys.append(time)
        curves = [_curve(mlp_rows, "num_tokens", op) for op in _LAYER_TOKEN_OPS]
        curves.append(MonotoneCurve(save_xs, save_ys))
        emb = _curve(mlp_rows, "num_tokens", "emb")
        xs = sorted({x for c in (*curves, emb) for x in c.xs})
        # A sum of piecewise-linear curves is piecewise linear with their breakpoints.
        ys = [sum(c(x) for c in curves) + emb(x) / self.shape.num_layers for x in xs]
        return MonotoneCurve(xs, ys)


def _read_rows(path: Path) -> list[dict]:
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except FileNotFoundError:
        raise ProfileError(
            f"{path}: no such file (a profile directory holds {ATTENTION_CSV} and {MLP_CSV})"
        ) from None
    if not rows:
        raise ProfileError(f"{path}: no rows")
    tp = [r for r in rows if r.get("num_tensor_parallel_workers", "1") == "1"]
    if not tp:
        raise ProfileError(f"{path}: no rows for one GPU (num_tensor_parallel_workers 1)")
    return tp


def _median(row: dict, op: str) -> float | None:
    """The operator's median time in ms; the mean where the median cell is empty."""
    for stat in ("median", "mean"):
        value = row.get(f"time_stats.{op}.{stat}", "")
        if value not in ("", "nan", "NaN"):
            return float(value)
    return None


def _curve(rows: list[dict], x_key: str, op: str) -> MonotoneCurve:
    points = [(float(r[x_key]), t) for r in rows if (t := _median(r, op)) is not None]
    if not points:
        raise ProfileError(f"the profile has no times for {op}")
    return MonotoneCurve([x for x, _ in points], [y for _, y in points])


def _grid_from_rows(rows: list[dict], x_key: str, y_key: str, op: str) -> MonotoneGrid:
    """A grid over (x, y) from scattered rows: one monotone curve over y per x value,
    read at the union of all y values."""
    by_x: dict[float, list[tuple[float, float]]] = defaultdict(list)
    for r in rows:
        time = _median(r, op)
        if time is not None:
            by_x[float(r[x_key])].append((float(r[y_key]), time))
    if not by_x:
        raise ProfileError(f"the profile has no times for {op}")
    xs = sorted(by_x)
    ys = sorted({y for points in by_x.values() for y, _ in points})
    values = []
    for x in xs:
        curve = MonotoneCurve([y for y, _ in by_x[x]], [t for _, t in by_x[x]])
        values.append([curve(y) for y in ys])
    return MonotoneGrid([xs, ys], values)


def _check_matches(
    shape: ModelShape, mlp_rows: list[dict], attention_rows: list[dict], profile_dir: Path
) -> None:
    """The profile must have been measured for this shape (per GPU, tensor parallel 1)."""
    expected = {
        MLP_CSV: (
            mlp_rows,
            {
                "n_embd": shape.hidden_size,
                "n_head": shape.num_attention_heads,
                "n_kv_head": shape.num_key_value_heads,
                "n_expanded_embd": shape.intermediate_size,
            },
        ),
        ATTENTION_CSV: (
            attention_rows,
            {
                "n_embd": shape.hidden_size,
                "n_q_head": shape.num_attention_heads,
                "n_kv_head": shape.num_key_value_heads,
            },
        ),
    }
    for name, (rows, keys) in expected.items():
        for key, want in keys.items():
            found = {r[key] for r in rows if key in r}
            if found and found != {str(want)}:
                raise ProfileError(
                    f"{profile_dir / name} was measured with {key} {', '.join(sorted(found))}, "
                    f"but the model shape ({shape.name}) has {want}"
                )
