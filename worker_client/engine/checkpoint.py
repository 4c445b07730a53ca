"""Read a HF safetensors checkpoint into the tensors our model's parameters expect.

Names are transformers' on-disk names with two allowances: a composite
(vision-language) checkpoint's `model.language_model.` prefix is dropped (its
vision tower and MTP head are skipped), and MoE experts may be stored one
tensor per expert and projection (`mlp.experts.7.gate_proj.weight`, as
transformers' save_pretrained and Qwen3-Next checkpoints write them) or stacked
(`mlp.experts.gate_up_proj` [E, 2 * I, H], `mlp.experts.down_proj` [E, H, I]).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch

from .errors import CheckpointError

# Tensors of composite (vision-language) checkpoints that a text model does not use.
_IGNORED_PREFIXES = ("mtp.", "model.visual.", "visual.")
_COMPOSITE_PREFIX = "model.language_model."
_PER_EXPERT = re.compile(
    r"^(?P<experts>.+\.mlp\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


def read_checkpoint(
    model_dir: Path, expected: Mapping[str, torch.Size], device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Every tensor of `model_dir/*.safetensors` named in `expected`, on `device` in `dtype`.

    Raises CheckpointError for no files, an unexpected tensor, a shape that
    disagrees with `expected`, or an expert stack with experts missing. Tensors
    absent from the files are left out (the caller names what it cannot do without).
    """
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    stacks = _ExpertStacks(expected, device, dtype)
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for raw_name in handle.keys():
                name = _canonical_name(raw_name)
                if name is None:
                    continue
                if stacks.accepts(name):
                    stacks.add(file.name, raw_name, name, handle.get_tensor(raw_name))
                    continue
                if name not in expected:
                    raise CheckpointError(f"{file.name}: unexpected tensor {raw_name!r}")
                tensor = handle.get_tensor(raw_name)
                _check_shape(file.name, raw_name, tuple(tensor.shape), tuple(expected[name]))
                tensors[name] = tensor.to(device=device, dtype=dtype)
    tensors.update(stacks.complete(model_dir))
    return tensors


class _ExpertStacks:
    """Builds the stacked expert tensors from per-expert ones, and notices experts missing."""

    def __init__(
        self, expected: Mapping[str, torch.Size], device: torch.device, dtype: torch.dtype
    ) -> None:
        self._expected = expected
        self._device = device
        self._dtype = dtype
        self._stacks: dict[str, torch.Tensor] = {}
        self._filled: dict[str, set[tuple[int, str]]] = {}

    def accepts(self, name: str) -> bool:
        match = _PER_EXPERT.match(name)
        return match is not None and f"{match['experts']}.gate_up_proj" in self._expected

    def add(self, file_name: str, raw_name: str, name: str, tensor: torch.Tensor) -> None:
        match = _PER_EXPERT.match(name)
        assert match is not None
        index, proj = int(match["index"]), match["proj"]
        target = f"{match['experts']}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
        num_experts, rows, columns = self._expected[target]
        if index >= num_experts:
            raise CheckpointError(
                f"{file_name}: {raw_name!r} names expert {index}, "
                f"config.json has {num_experts} experts"
            )
        # gate_up_proj[e] holds the gate rows, then the up rows.
        if proj == "down_proj":
            expected_shape, row_slice = (rows, columns), slice(0, rows)
        else:
            half = rows // 2
            expected_shape = (half, columns)
            row_slice = slice(0, half) if proj == "gate_proj" else slice(half, rows)
        _check_shape(file_name, raw_name, tuple(tensor.shape), expected_shape)
        if target not in self._stacks:
            self._stacks[target] = torch.empty(
                self._expected[target], device=self._device, dtype=self._dtype
            )
            self._filled[target] = set()
        self._stacks[target][index, row_slice] = tensor.to(device=self._device, dtype=self._dtype)
        self._filled[target].add((index, proj))

    def complete(self, model_dir: Path) -> dict[str, torch.Tensor]:
        for target, filled in self._filled.items():
            num_experts = self._expected[target][0]
            projs = ("down_proj",) if target.endswith("down_proj") else ("gate_proj", "up_proj")
            missing = sorted({(e, p) for e in range(num_experts) for p in projs} - filled)
            if missing:
                experts = target[: -len(target.rsplit(".", 1)[1])]
                examples = [f"{experts}{e}.{p}.weight" for e, p in missing[:3]]
                raise CheckpointError(
                    f"checkpoint in {model_dir} lacks {len(missing)} expert tensors, "
                    f"e.g. {examples}"
                )
        return dict(self._stacks)


def _check_shape(
    file_name: str, raw_name: str, shape: tuple[int, ...], expected: tuple[int, ...]
) -> None:
    if shape != expected:
        raise CheckpointError(
            f"{file_name}: {raw_name!r} has shape {shape}, config.json implies {expected}"
        )


def _canonical_name(raw_name: str) -> str | None:
    """The model's name for a checkpoint tensor; None for tensors a text model ignores."""
    if raw_name.startswith(_COMPOSITE_PREFIX):
        return "model." + raw_name[len(_COMPOSITE_PREFIX) :]
    if raw_name.startswith(_IGNORED_PREFIXES):
        return None
    return raw_name
