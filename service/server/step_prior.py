"""`serve --step-table FILE`: the step-time model a worker's learning starts from, fitted
to a `lattice-worker profile` table read on a grid of step shapes."""

from __future__ import annotations

from common import step_table
from common.errors import ConfigError
from common.step_table import StepLoad
from service.core.learn.step_model import StepShape, StepTimeModel, chunk_attention

# The grid the table is read on: prefill tokens, decodes, context per sequence.
_PREFILL_TOKENS = (0, 32, 128, 256, 512, 1024, 2048)
_DECODES = (0, 1, 8, 32, 64)
_CONTEXTS = (0, 512, 2048)


def load_step_prior(path: str) -> StepTimeModel:
    """A model fitted to the step table at `path`; ConfigError naming it if unreadable."""
    try:
        model = step_table.StepTableModel(step_table.load(path))
    except (OSError, ValueError) as err:
        raise ConfigError(f"step_table {path!r}: {err}") from None
    samples = []
    for prefill in _PREFILL_TOKENS:
        for decodes in _DECODES:
            for context in _CONTEXTS:
                if not (prefill or decodes):
                    continue
                load = StepLoad(((prefill, context),) if prefill else (), (context,) * decodes)
                shape = StepShape(
                    prefill,
                    chunk_attention(context, prefill) if prefill else 0.0,
                    decodes,
                    decodes * context,
                )
                samples.append((shape, model.step_seconds(load)))
    return StepTimeModel.fitted(samples)
