"""Logging set-up: plain text, or one JSON object per line with seq_id/worker_id fields.

Log lines carry values callers chose (worker_id, request_id, error messages). Neither
format lets such a value start a line of its own or pose as another field:
- text: every field of the record line has its control characters escaped (`\\n`,
  `\\x1b`, `\\u2028`, ...), and an `extra` value with a space, `=` or `"` in it is quoted;
  the lines of a traceback follow indented, so only a record's own line starts unindented;
- JSON: one object per line (json.dumps escapes control characters), non-finite numbers
  as strings (NaN is not JSON).
"""

from __future__ import annotations

import json
import logging
import sys
import time

# Attributes a LogRecord has of its own; anything else came through `extra=`.
_RECORD_ATTRS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}

# C0 and C1 controls, DEL, and the Unicode line and paragraph separators.
_CONTROL = [*range(0x00, 0x20), *range(0x7F, 0xA0), 0x2028, 0x2029]
_ESCAPES = {
    c: {0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"}.get(c, f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}")
    for c in _CONTROL
}
_NEEDS_QUOTES = frozenset(' ="')


def escape(text: str) -> str:
    """`text` with every control character written as an escape: one line, always."""
    return text.translate(_ESCAPES)


def _field(value: object) -> str:
    text = escape(str(value))
    if not text or any(c in _NEEDS_QUOTES for c in text):
        return '"' + text.replace('"', '\\"') + '"'
    return text


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and every `extra` field."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in _RECORD_ATTRS})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        try:
            return json.dumps(entry, default=str, allow_nan=False)
        except ValueError:  # a non-finite number deeper down: NaN -> "NaN", and so on
            plain = json.loads(json.dumps(entry, default=str), parse_constant=str)
            return json.dumps(plain, allow_nan=False)


class TextFormatter(logging.Formatter):
    """`time level logger: message key=value ...` with the `extra` fields appended, each
    field escaped (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = escape(
            self._fmt
            % {
                "asctime": self.formatTime(record, self.datefmt),
                "levelname": record.levelname,
                "name": record.name,
                "message": record.getMessage(),
            }
        )
        extra = " ".join(
            f"{escape(str(k))}={_field(v)}"
            for k, v in vars(record).items()
            if k not in _RECORD_ATTRS
        )
        if extra:
            line = f"{line} {extra}"
        details = []
        if record.exc_info:
            details.append(self.formatException(record.exc_info))
        if record.stack_info:
            details.append(self.formatStack(record.stack_info))
        for text in details:
            line += "".join(f"\n    {escape(part)}" for part in text.splitlines())
        return line


def configure(log_format: str, level: str) -> None:
    """Send logs to stderr in the chosen format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
