"""Secrets that cannot leak by accident.

A `Secret` prints as `<redacted>` in reprs, f-strings, logs and exceptions; only
`reveal()` gives the value, and only the HTTP layers call it. As a second line of
defence every secret value is registered with `REDACTOR`, which the log formatter
applies to each finished line.

The redactor forgets what can no longer be used. A value registered with a lifetime (a
credential: the control plane refuses it once it expires) is scrubbed until that lifetime
and RETIRED_GRACE_SECONDS more have passed, and only the newest MAX_EXPIRING such values are
kept: a credential superseded by a renewal stays redactable until it expires or MAX_EXPIRING
newer ones have come, whichever is first. The cost of a line is then flat: it kept every
credential for ever before (one a minute: a line cost 0.31 ms after a day, 9.7 ms after 30
days, issue 48). Values without a lifetime (the tokens read from settings, a handful) are
kept until they are retired: a token file that changed (foundations/token_file.py) retires
the token it held, which is then scrubbed for as long as it may still be used (the control
plane's overlap, none for a client) and RETIRED_GRACE_SECONDS more.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

# After its lifetime a value is still scrubbed this long: a line about a call that failed as it expired.
RETIRED_GRACE_SECONDS = 60.0
# Values with a lifetime kept at once, the newest: with the defaults (credentials of an hour, a re-registration a
# minute) about 60 are alive at once; the bound holds whatever the lifetime (up to 30 days) and the pace.
MAX_EXPIRING = 256


class Redactor:
    def __init__(self, monotonic: Callable[[], float] = time.monotonic, max_expiring: int = MAX_EXPIRING,
                 grace: float = RETIRED_GRACE_SECONDS) -> None:
        self._monotonic = monotonic
        self._max_expiring = max_expiring
        self._grace = grace
        self._permanent: set[str] = set()
        self._expiring: dict[str, float] = {}  # value -> when it is forgotten (monotonic), oldest registered first
        self._values: tuple[str, ...] = ()  # what scrub looks for, rebuilt on every change
        self._next_purge = math.inf
        self._lock = threading.Lock()

    def register(self, value: str, lifetime: float | None = None) -> None:
        """Scrub `value` from every line: for ever, or with `lifetime` (seconds from now) until it ends and
        the grace after it (and while it is among the newest MAX_EXPIRING)."""
        if len(value) < 8:  # short strings would redact ordinary words
            return
        with self._lock:
            if lifetime is None:
                self._permanent.add(value)
                self._expiring.pop(value, None)
            elif value not in self._permanent:
                forget_at = self._monotonic() + max(0.0, lifetime) + self._grace
                previous = self._expiring.pop(value, forget_at)  # registered again: it is the newest now
                self._expiring[value] = max(forget_at, previous)
                while len(self._expiring) > self._max_expiring:  # the oldest registered goes first
                    del self._expiring[next(iter(self._expiring))]
            self._rebuild()

    def retire(self, value: str, lifetime: float = 0.0) -> None:
        """`value`, kept until now (for ever, or with a lifetime), is no longer in use from `lifetime` seconds from
        now: it is forgotten then and the grace after it. A value not kept is left alone."""
        with self._lock:
            if value in self._permanent:
                self._permanent.discard(value)
            elif value not in self._expiring:
                return
            else:
                del self._expiring[value]
            self._expiring[value] = self._monotonic() + max(0.0, lifetime) + self._grace  # the newest registered
            while len(self._expiring) > self._max_expiring:
                del self._expiring[next(iter(self._expiring))]
            self._rebuild()

    def forgets_at(self, value: str) -> float | None:
        """When `value` is forgotten (monotonic seconds); None when it is kept for ever, or not at all."""
        self._purge_if_due()
        return self._expiring.get(value)

    def __len__(self) -> int:
        """How many values are kept now."""
        self._purge_if_due()
        return len(self._values)

    def __contains__(self, value: object) -> bool:
        self._purge_if_due()
        return value in self._values

    def _purge_if_due(self) -> None:
        if self._monotonic() >= self._next_purge:
            with self._lock:
                self._rebuild()

    def _rebuild(self) -> None:
        # Under the lock. Longest first: a value that contains another is replaced whole.
        now = self._monotonic()
        for value in [v for v, at in self._expiring.items() if at <= now]:
            del self._expiring[value]
        self._values = tuple(sorted(self._permanent | self._expiring.keys(), key=len, reverse=True))
        self._next_purge = min(self._expiring.values(), default=math.inf)

    def scrub(self, text: str) -> str:
        self._purge_if_due()
        for value in self._values:
            if value in text:
                text = text.replace(value, "<redacted>")
        return text


REDACTOR = Redactor()


class Secret:
    __slots__ = ("_value",)

    def __init__(self, value: str, lifetime: float | None = None) -> None:
        """`lifetime`: seconds this value can be used for (a credential's); the redactor forgets it after that."""
        self._value = value
        REDACTOR.register(value, lifetime)

    def reveal(self) -> str:
        return self._value

    def __bool__(self) -> bool:
        return bool(self._value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)

    def __repr__(self) -> str:
        return "Secret(<redacted>)"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return "<redacted>"
