"""Replacing a file atomically: write a temporary file in the same folder, fsync, rename.
A reader sees the old content or the new, never half of either."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import tempfile
from pathlib import Path

from gpu_agent.foundations.config import ConfigError


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise



def open_database(path: Path, what: str, flag: str, schema: str) -> sqlite3.Connection:
    """A SQLite database in WAL mode with full fsync, its schema applied. A file that cannot be
    opened or written is a configuration error naming the file and the flag that moves it."""
    try:
        if str(path) != ":memory:":
            path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.executescript(schema)
    except (OSError, sqlite3.Error) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise ConfigError(f"{what} {path} cannot be opened for writing ({reason}); point {flag} at a writable file") from None
    return db
