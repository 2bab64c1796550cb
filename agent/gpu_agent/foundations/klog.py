"""klog-style logging: `I1129 22:43:40.123456   12345 module.py:42] message`.

Verbosity follows klog: `-v N` shows every message logged at V(n) for n <= N. Level 0 is
always shown (start-up config, state transitions); 2 adds gate and registration detail;
4 adds per-item queue work; 6 adds every control-plane round trip. Warnings and errors
are always shown. Each finished line passes through the secret redactor.
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import UTC, datetime
from typing import TextIO

from gpu_agent.foundations.secrets import REDACTOR

_LEVEL_LETTER = {logging.DEBUG: "I", logging.INFO: "I", logging.WARNING: "W", logging.ERROR: "E", logging.CRITICAL: "F"}
ROOT = "gpu_agent"


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


class KlogFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created, tz=UTC)
        letter = _LEVEL_LETTER.get(record.levelno, "I" if record.levelno < logging.WARNING else "W")
        head = f"{letter}{ts:%m%d %H:%M:%S}.{ts.microsecond:06d} {record.process:>7} {record.filename}:{record.lineno}]"
        # One record is one line, whatever its arguments hold; only a traceback adds lines.
        text = f"{head} {quote(record.getMessage())}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return REDACTOR.scrub(text)


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


def setup(verbosity: int, stream: TextIO | None = None) -> None:
    root = logging.getLogger(ROOT)
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(KlogFormatter())
    root.addHandler(handler)
    root.setLevel(_level_for_v(verbosity))
    root.propagate = False
    from gpu_agent.foundations.http import route_waitress_logs

    route_waitress_logs(handler)
    for i in range(1, 8):
        logging.addLevelName(_level_for_v(i), f"V{i}")
    if os.environ.get("PYTHONWARNINGS") is None:
        logging.captureWarnings(True)
