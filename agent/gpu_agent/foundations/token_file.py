"""Tokens read from a file that may change under a running process: rotated without a restart (issue 48).

A Kubernetes Secret volume is updated by an atomic swap of its `..data` symlink to a new timestamped folder
(`registrationToken -> ..data/registrationToken`), so a path read anew gives the old content or the new, never
half. `TokenFile.current()` looks at the file on every use: a `stat` of the path, links followed (inode, size,
modification and change times); only when that differs is the file read again. A token that changed replaces
the one in use; the one it replaced is retired from the log redactor (foundations/secrets.py) once it can no
longer be used.

A file that became empty, unreadable, not UTF-8 or absent (a Secret whose key was dropped, a mode that locks the
process out) leaves the last good token in use, with one warning per change naming the file and the fix, never
the token. The next change that holds a token is taken as any change is.

A server (the reference control plane) gives its token files an `overlap`: for that long after a change the token
replaced is still accepted beside the new one (`accepted()`), so that every client, which reads its own copy of
the Secret when its kubelet updates it (up to about a minute apart, plus the clients' own pace), moves over
without a refused call. Only the token just replaced is kept: a second change within the overlap drops the first
token at once. A token that came from the environment never changes: `FixedToken`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Protocol

from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.secrets import REDACTOR, Secret

log = get_logger(__name__)

# A token is a line of a few dozen characters; a file much larger than that is not one (and is not read whole).
MAX_TOKEN_BYTES = 4096


class TokenSource(Protocol):
    def current(self) -> Secret:
        """The token to present (a client) or the newest accepted (a server)."""
        ...

    def accepted(self) -> tuple[Secret, ...]:
        """The tokens a server accepts now: the current one, and the one it replaced while within its overlap."""
        ...


class FixedToken:
    """A token that cannot change while the process runs (from the environment, or made by the process)."""

    def __init__(self, token: Secret) -> None:
        self._token = token

    def current(self) -> Secret:
        return self._token

    def accepted(self) -> tuple[Secret, ...]:
        return (self._token,)


def as_source(token: Secret | TokenSource) -> TokenSource:
    return FixedToken(token) if isinstance(token, Secret) else token


def read_token(path: str) -> str:
    """The file's token, stripped ("" when it holds none); OSError, or ValueError for what is not a token."""
    with open(path, "rb") as f:
        raw = f.read(MAX_TOKEN_BYTES + 1)
    if len(raw) > MAX_TOKEN_BYTES:
        raise ValueError(f"it is larger than {MAX_TOKEN_BYTES} bytes, which no token is")
    try:
        return raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ValueError("it is not UTF-8 text") from None


def signature(path: str) -> tuple[int, ...]:
    """What changes when the file does. stat follows links: a Secret volume's `key -> ..data/key` link never
    changes, the file it leads to does (a new inode in a new folder). A file that cannot be stat'ed: its errno."""
    try:
        st = os.stat(path)
    except OSError as e:
        return (e.errno or -1,)
    return (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class TokenFile:
    """The token in `path`, read again whenever the file changes.

    `setting` and `flag` name where the path came from, for the warning. `overlap` (seconds, on `clock`): how long
    the token replaced by a change is still accepted (`accepted()`) and scrubbed from the logs; 0 for a client.
    `initial`: the token already read from the file at start (config.load), used if the file cannot be read now.
    `read` and `stat` are injectable for tests."""

    def __init__(self, path: str, setting: str, flag: str, *, overlap: float = 0.0,
                 clock: Callable[[], float] = time.monotonic, initial: Secret | None = None,
                 read: Callable[[str], str] = read_token,
                 stat: Callable[[str], tuple[int, ...]] = signature) -> None:
        self.path, self.setting, self.flag = path, setting, flag
        self.overlap = overlap
        self._clock, self._read, self._stat = clock, read, stat
        self._lock = threading.Lock()
        self._previous: Secret | None = None
        self._previous_until = 0.0
        # stat before read: a change between the two is seen again at the next use (read once more, same token).
        self._seen = stat(path)
        first = self._try_read()
        self._current = Secret(first) if first else (initial if initial is not None else Secret(""))

    def current(self) -> Secret:
        self._check()
        return self._current

    def accepted(self) -> tuple[Secret, ...]:
        self._check()
        previous = self._previous
        return (self._current,) if previous is None else (self._current, previous)

    def _try_read(self) -> str | None:
        """The file's token, or None (warned) when it holds none or cannot be read."""
        try:
            token = self._read(self.path)
        except (OSError, ValueError) as e:
            why = (e.strerror or str(e)) if isinstance(e, OSError) else str(e)
            problem = f"cannot be read ({why})"
        else:
            if token:
                return token
            problem = "is empty"
        log.warning("%s %s %s: still using the token read before; put the token back in it (with Kubernetes: the "
                    "Secret's key, mounted without subPath) or point %s at a readable file", self.setting, self.path,
                    problem, self.flag)
        return None

    def _check(self) -> None:
        seen = self._stat(self.path)
        with self._lock:
            if self._previous is not None and self._clock() >= self._previous_until:
                log.info("%s %s: the token it held before its last change is no longer accepted (its overlap of "
                         "%gs ended)", self.setting, self.path, self.overlap)
                self._previous = None
            if seen == self._seen:
                return
            self._seen = seen
            token = self._try_read()
            if token is None or token == self._current.reveal():
                return
            old, self._current = self._current, Secret(token)
            if self._previous is not None and self._previous != self._current:
                REDACTOR.retire(self._previous.reveal())  # replaced twice within the overlap: no longer accepted
            self._previous = None
            if old and self.overlap > 0:
                self._previous, self._previous_until = old, self._clock() + self.overlap
            if old and old != self._current:
                REDACTOR.retire(old.reveal(), self.overlap)
            log.info("%s %s changed: using the new token%s", self.setting, self.path,
                     f"; the one it replaces is still accepted for {self.overlap:g}s" if self._previous else "")
