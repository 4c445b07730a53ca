"""How the engine tests compare logits, so that they hold on any x86 CPU.

Float32 results move with the host's kernels (AVX2, AVX-512, AMX, thread
count), so a fixed float32 tolerance either fails on some host or is loose.
Instead:

1. Equivalence in float64. Our model runs in float64 throughout
   (layers.upcast); transformers' float64 run would still round to fp32 inside
   (its norms, router softmax, RoPE and delta rule cast with `.float()` /
   `torch.float32`), so `Float64Transformers` runs it with those casts
   redirected to float64. Both are then exact up to float64 rounding (measured:
   1e-14 to 4e-13 on logits of scale ~5, for every family) and must agree within
   FLOAT64_RTOL of the logits' scale, 3 orders of magnitude above that on any
   host and 4 below what a real error does: a wrong weight, row, slot, page,
   position or state moves logits by 1e-4 of their scale or more (the mutation
   test scales one expert of one layer by 1 + 1e-6 and is caught).
   Engine-against-engine comparisons (batched vs alone, packed vs one chunk at a
   time) use the same float64 rule.
2. The float32 error, bounded by transformers' own on the same host. Our
   float32 logits may be at most SPREAD_FACTOR times further from the exact
   (float64) logits than transformers' float32 logits are (measured ratio
   0.67-1.03). The spread must itself stay below MAX_SPREAD_RTOL of the logits'
   scale, so this bound cannot grow loose on a badly conditioned input; it
   catches precision mistakes (a step left in bfloat16, a lost upcast) that the
   float64 check cannot see.

Greedy token equality is always exact.
"""

from __future__ import annotations

import contextlib
import importlib
import types
from collections.abc import Iterator

import torch

FLOAT64_RTOL = 1e-10
SPREAD_FACTOR = 3.0
MAX_SPREAD_RTOL = 1e-3


def max_abs(t: torch.Tensor) -> float:
    return float(t.double().abs().max())


def assert_float64_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Two float64 computations of the same logits agree up to float64 rounding."""
    assert actual.dtype == expected.dtype == torch.float64
    scale = max_abs(expected)
    difference = max_abs(actual - expected)
    assert difference <= FLOAT64_RTOL * scale, (
        f"float64 logits differ by {difference:.3e}, allowed {FLOAT64_RTOL * scale:.3e}"
    )


def assert_float32_error_bounded(
    ours32: torch.Tensor, hf32: torch.Tensor, exact: torch.Tensor
) -> None:
    """Our float32 logits at most SPREAD_FACTOR x as far from `exact` (float64) as transformers' float32 ones."""
    scale = max_abs(exact)
    spread = max_abs(hf32.double() - exact)
    assert spread <= MAX_SPREAD_RTOL * scale, (
        f"transformers' own float32 error {spread:.3e} exceeds {MAX_SPREAD_RTOL} of the logits' "
        f"scale {scale:.3f}: too ill-conditioned an input to bound anything on"
    )
    error = max_abs(ours32.double() - exact)
    assert error <= SPREAD_FACTOR * spread, (
        f"our float32 logits are {error:.3e} from the float64 ones, allowed {SPREAD_FACTOR} x "
        f"transformers' own float32 error {spread:.3e} on this host"
    )


class Float64Transformers:
    """A transformers causal LM computing in float64 throughout, for use as an exact reference.

    Its modeling module's `torch.float32` / `torch.float` and `Tensor.float()`
    mean float64 while it is built and while it runs (test-only: the patch is
    undone after each call). If a transformers release adds a cast this does not
    reach, the float64 comparisons fail loudly rather than pass loosely.
    """

    def __init__(self, reference: torch.nn.Module) -> None:
        self._module = importlib.import_module(type(reference).__module__)
        with self._float64():
            self.model = type(reference)(reference.config).double().eval()
            self.model.load_state_dict(reference.state_dict())
            if _has_experts(self.model):
                self.model.set_experts_implementation("eager")  # grouped_mm takes no float64

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        with self._float64(), torch.no_grad():
            return self.model(torch.tensor([token_ids])).logits[0]

    @contextlib.contextmanager
    def _float64(self) -> Iterator[None]:
        saved_torch, saved_float = self._module.torch, torch.Tensor.float
        self._module.torch = _Float64Torch("torch")
        torch.Tensor.float = torch.Tensor.double
        try:
            yield
        finally:
            self._module.torch = saved_torch
            torch.Tensor.float = saved_float


class _Float64Torch(types.ModuleType):
    """The torch module, except that float32 is float64."""

    def __getattr__(self, name: str):
        if name in ("float", "float32"):
            return torch.float64
        return getattr(torch, name)


def _has_experts(model: torch.nn.Module) -> bool:
    return any(name.endswith("mlp.experts") for name, _ in model.named_modules())
