"""Capped exponential backoff with bounded jitter.

The base delay of attempt n is `initial * factor**n`, capped at `cap`; a configured
`initial` above `cap` is kept as it is (a deliberately slow interval is never shortened).
Jitter modes:
  shorten    (default) the delay is drawn from `[base * (1 - jitter), base]`: the cap is a hard
             upper bound and lock-step retries still spread out;
  symmetric  `base * U[1 - jitter, 1 + jitter)`, as NVIDIA's DRA driver does (x U[0.75, 1.25));
  full       `U[0, base)`, "full jitter": the widest spread, for many writers on one object.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Backoff:
    initial: float
    cap: float
    factor: float = 2.0
    jitter: float = 0.2
    rng: random.Random = field(default_factory=random.Random)
    attempt: int = 0
    mode: str = "shorten"

    def __post_init__(self) -> None:
        if self.initial <= 0:
            raise ValueError("initial must be > 0")
        if self.cap <= 0:
            raise ValueError("cap must be > 0")
        if not 0.0 <= self.jitter < 1.0:
            raise ValueError("jitter must be in [0, 1)")
        if self.mode not in ("shorten", "symmetric", "full"):
            raise ValueError("mode must be shorten, symmetric or full")

    def base(self, attempt: int) -> float:
        if self.initial >= self.cap:
            return self.initial
        # The exponent is bounded so that a long outage cannot overflow a float.
        return min(self.cap, self.initial * self.factor ** min(attempt, 64))

    @property
    def current_base(self) -> float:
        """The base delay the next failure will be given."""
        return self.base(self.attempt)

    def next_delay(self) -> float:
        base = self.base(self.attempt)
        self.attempt += 1
        if self.mode == "full":
            return base * self.rng.random()
        if not self.jitter:
            return base
        if self.mode == "symmetric":
            return base * (1.0 - self.jitter + 2.0 * self.jitter * self.rng.random())
        return base * (1.0 - self.jitter * self.rng.random())

    def reset(self) -> None:
        self.attempt = 0
