"""Log injection: values a caller chooses cannot forge log lines in either format.

Regression (outside probe): a worker_id holding a newline wrote a forged line
(`lattice_scheduler_workers 999`) into the text log.
"""

from __future__ import annotations

import json
import logging
import sys

import pytest

from common.logs import JsonFormatter, TextFormatter, escape
from lattice.scheduler.v1 import scheduler_pb2 as pb

from .wire import RPC_TIMEOUT_SECONDS

FORGED = "lattice_scheduler_workers 999"
HOSTILE_IDS = [
    f"w\n{FORGED}",
    f"w\r{FORGED}",
    f"w\u2028{FORGED}",
    f"w\x85{FORGED}",
    "w\x1b[2J\x1b[H",
    "w\x00\x7f\t",
]


def _record(**extra) -> logging.LogRecord:
    return logging.makeLogRecord(
        {
            "msg": "worker registered",
            "levelname": "INFO",
            "levelno": logging.INFO,
            "name": "service.server.servicer",
            **extra,
        }
    )


def _one_clean_line(text: str) -> None:
    assert len(text.splitlines()) == 1, text
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 or c in "\u2028\u2029" for c in text), (
        repr(text)
    )


@pytest.mark.parametrize("worker_id", HOSTILE_IDS)
def test_text_log_lines_escape_control_characters_in_extra_fields(worker_id):
    line = TextFormatter().format(_record(worker_id=worker_id))
    _one_clean_line(line)
    assert f"worker_id={escape(worker_id)}" in line or f'worker_id="{escape(worker_id)}"' in line


@pytest.mark.parametrize("worker_id", HOSTILE_IDS)
def test_text_log_lines_escape_control_characters_in_the_message_and_logger(worker_id):
    record = _record(msg="worker %s registered", args=(worker_id,), name=f"x\n{FORGED}")
    _one_clean_line(TextFormatter().format(record))


def test_an_extra_value_cannot_pose_as_another_field():
    line = TextFormatter().format(_record(worker_id="w requeued=5"))
    assert line.endswith('worker_id="w requeued=5"')


def test_traceback_lines_are_indented_under_their_record():
    try:
        raise ValueError(f"bad\n{FORGED}")
    except ValueError:
        record = _record(exc_info=sys.exc_info())
    first, *rest = TextFormatter().format(record).split("\n")
    _one_clean_line(first)
    assert rest and all(line.startswith("    ") for line in rest)


@pytest.mark.parametrize("worker_id", HOSTILE_IDS)
def test_json_log_lines_stay_one_valid_object(worker_id):
    line = JsonFormatter().format(
        _record(worker_id=worker_id, ratio=float("nan"), nested={"x": float("inf")})
    )
    assert len(line.splitlines()) == 1
    entry = json.loads(line)
    assert entry["worker_id"] == worker_id
    assert entry["ratio"] == "NaN" and entry["nested"] == {"x": "Infinity"}


def test_a_worker_id_with_a_newline_over_the_wire_forges_no_log_line(stub, caplog):
    caplog.set_level(logging.INFO)
    worker_id = f"w\n{FORGED}"
    stub.RegisterWorker(
        pb.RegisterWorkerRequest(
            worker_id=worker_id, total_kv_pages=8, page_size=16, total_gdn_slots=2
        ),
        timeout=RPC_TIMEOUT_SECONDS,
    )
    stub.DeregisterWorker(
        pb.DeregisterWorkerRequest(worker_id=worker_id), timeout=RPC_TIMEOUT_SECONDS
    )
    records = [r for r in caplog.records if getattr(r, "worker_id", None) == worker_id]
    assert len(records) == 2
    for record in records:
        text = TextFormatter().format(record)
        _one_clean_line(text)
        assert not any(line.startswith(FORGED) for line in text.splitlines())
        assert json.loads(JsonFormatter().format(record))["worker_id"] == worker_id
