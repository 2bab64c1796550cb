"""klog-style logging: `I1129 22:43:40.123456   12345 module.py:42] message`, or one JSON object a line.

Verbosity follows klog: `-v N` shows every message logged at V(n) for n <= N. Level 0 is
always shown (start-up config, state transitions); 2 adds gate and registration detail;
4 adds per-item queue work; 6 adds every control-plane round trip. Warnings and errors
are always shown. Each finished line passes through the secret redactor.

The setting `logFormat` (every command's `--log-format`) picks the line: `text` (the default, the klog line above)
or `json`, for log pipelines: one object a line with the keys of Kubernetes' structured JSON logging, always all of
them and always of one type (JSON_KEYS), e.g.

    {"ts": 1732920220.123456, "level": "info", "v": 0, "logger": "gpu_agent.roles.cluster_agent",
     "caller": "cluster_agent.py:42", "msg": "registered", "pid": 12345, "thread": "MainThread", "err": null}

`ts` is the Unix time in seconds; `v` the message's V(n) (0 for info, warnings and errors); `level` klog's letter
named (I info, W warning, E error, F fatal); `err` the traceback of the exception logged with the line, else null.
Redaction is the same as text's: every string is scrubbed before it is escaped (a secret holding a quote or a
backslash is escaped in JSON, and would no longer match), and the finished line is scrubbed again. The line is
ASCII (json's escapes): no character a reader could take for a line break survives in it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime
from typing import TextIO

from gpu_agent.foundations.secrets import REDACTOR

_LEVEL_LETTER = {logging.DEBUG: "I", logging.INFO: "I", logging.WARNING: "W", logging.ERROR: "E", logging.CRITICAL: "F"}
_LEVEL_NAME = {"I": "info", "W": "warning", "E": "error", "F": "fatal"}
ROOT = "gpu_agent"
FORMATS = ("text", "json")
# A JSON line's keys, in order, and the JSON type of each (err: the traceback, null when there is none).
JSON_KEYS: dict[str, str] = {"ts": "number", "level": "string", "v": "integer", "logger": "string", "caller": "string",
                             "msg": "string", "pid": "integer", "thread": "string", "err": "string or null"}


def _level_for_v(v: int) -> int:
    # V(0) is INFO (20); V(n) is 20 - n, so V(7) is 13, still above DEBUG.
    return logging.INFO - v


def quote(value: object) -> str:
    """A value from outside, safe inside one log line: control characters (a newline that would
    forge a second line, an escape sequence) are written as escapes."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _letter(record: logging.LogRecord) -> str:
    return _LEVEL_LETTER.get(record.levelno, "I" if record.levelno < logging.WARNING else "W")


class KlogFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created, tz=UTC)
        letter = _letter(record)
        head = f"{letter}{ts:%m%d %H:%M:%S}.{ts.microsecond:06d} {record.process:>7} {record.filename}:{record.lineno}]"
        # One record is one line, whatever its arguments hold; only a traceback adds lines.
        text = f"{head} {quote(record.getMessage())}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return REDACTOR.scrub(text)


class JsonFormatter(logging.Formatter):
    """One JSON object a line, keys and types JSON_KEYS; scrubbed field by field, then as a line."""

    def format(self, record: logging.LogRecord) -> str:
        letter = _letter(record)
        fields: dict[str, object] = {
            "ts": record.created,
            "level": _LEVEL_NAME[letter],
            "v": logging.INFO - record.levelno if record.levelno < logging.INFO else 0,
            "logger": REDACTOR.scrub(record.name),
            "caller": REDACTOR.scrub(f"{record.filename}:{record.lineno}"),
            "msg": REDACTOR.scrub(record.getMessage()),
            "pid": record.process if record.process is not None else os.getpid(),
            "thread": REDACTOR.scrub(str(record.threadName)),
            "err": REDACTOR.scrub(self.formatException(record.exc_info)) if record.exc_info else None,
        }
        return REDACTOR.scrub(json.dumps(fields, ensure_ascii=True))


class Logger:
    """A thin face over `logging.Logger` with klog's `V(n)`."""

    def __init__(self, name: str) -> None:
        self._log = logging.getLogger(name if name.startswith(ROOT) else f"{ROOT}.{name}")

    def v(self, level: int, msg: str, *args: object) -> None:
        self._log.log(_level_for_v(level), msg, *args, stacklevel=2)

    def enabled(self, level: int) -> bool:
        return self._log.isEnabledFor(_level_for_v(level))

    def info(self, msg: str, *args: object) -> None:
        self._log.info(msg, *args, stacklevel=2)

    def warning(self, msg: str, *args: object) -> None:
        self._log.warning(msg, *args, stacklevel=2)

    def error(self, msg: str, *args: object, exc_info: bool = False) -> None:
        self._log.error(msg, *args, exc_info=exc_info, stacklevel=2)


def get_logger(name: str) -> Logger:
    return Logger(name)


def formatter(log_format: str = "text") -> logging.Formatter:
    """The formatter of the setting logFormat's value (the settings loader has checked it is one of FORMATS)."""
    if log_format not in FORMATS:
        raise ValueError(f"log format {log_format!r} is not one of {', '.join(FORMATS)} (the setting logFormat)")
    return JsonFormatter() if log_format == "json" else KlogFormatter()


def setup(verbosity: int, stream: TextIO | None = None, log_format: str = "text") -> None:
    root = logging.getLogger(ROOT)
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(formatter(log_format))
    root.addHandler(handler)
    root.setLevel(_level_for_v(verbosity))
    root.propagate = False
    from gpu_agent.foundations.http import route_waitress_logs

    route_waitress_logs(handler)
    for i in range(1, 8):
        logging.addLevelName(_level_for_v(i), f"V{i}")
    if os.environ.get("PYTHONWARNINGS") is None:
        logging.captureWarnings(True)
