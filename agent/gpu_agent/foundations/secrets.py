"""Secrets that cannot leak by accident.

A `Secret` prints as `<redacted>` in reprs, f-strings, logs and exceptions; only
`reveal()` gives the value, and only the HTTP layers call it. As a second line of
defence every secret value is registered with `REDACTOR`, which the log formatter
applies to each finished line.
"""

from __future__ import annotations

import threading


class Redactor:
    def __init__(self) -> None:
        self._values: set[str] = set()
        self._lock = threading.Lock()

    def register(self, value: str) -> None:
        if len(value) >= 8:  # short strings would redact ordinary words
            with self._lock:
                self._values.add(value)

    def scrub(self, text: str) -> str:
        with self._lock:
            values = list(self._values)
        for value in values:
            if value in text:
                text = text.replace(value, "<redacted>")
        return text


REDACTOR = Redactor()


class Secret:
    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value
        REDACTOR.register(value)

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
