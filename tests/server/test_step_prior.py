"""serve --step-table: each worker's learned step time starts from a profiled table."""

from __future__ import annotations

import pytest

from common import step_table
from common.errors import ConfigError
from common.step_table import StepTable
from service.core.learn.step_model import StepShape, chunk_attention
from service.server.step_prior import load_step_prior

_PREFILL, _DECODES, _CONTEXTS = (0, 64, 256, 1024, 2048), (0, 1, 8, 32, 64), (0, 512, 2048)


def _seconds(prefill: int, decodes: int, context: int) -> float:
    return 0.012 + 6e-5 * prefill + 4e-4 * decodes + 1e-7 * decodes * context


def test_the_prior_predicts_the_table(tmp_path):
    table = StepTable(
        _PREFILL,
        _DECODES,
        _CONTEXTS,
        tuple(
            tuple(tuple(_seconds(p, d, c) for c in _CONTEXTS) for d in _DECODES) for p in _PREFILL
        ),
    )
    path = tmp_path / "table.json"
    step_table.save(table, path)
    model = load_step_prior(str(path))
    for prefill, decodes, context in ((512, 16, 1000), (0, 48, 2000), (1500, 0, 0)):
        shape = StepShape(prefill, chunk_attention(0, prefill), decodes, decodes * context)
        assert model.predict(shape) == pytest.approx(_seconds(prefill, decodes, context), rel=0.1)
    assert model.num_steps == 0


def test_an_unreadable_table_names_the_setting(tmp_path):
    with pytest.raises(ConfigError, match="step_table"):
        load_step_prior(str(tmp_path / "missing.json"))
