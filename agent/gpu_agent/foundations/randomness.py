"""One random source per agent, split by part.

An agent is given one random source (seeded in tests and in the simulation, fresh otherwise) and
hands each part that draws (registration's retry jitter, the election's, the domain writer's) a
source of its own, derived from one draw of the given source and the part's name. So parts never
share draws (one part drawing more never shifts another's sequence), the same seed gives every part
the same sequence, and adding a part leaves the others' sequences as they were.
"""

from __future__ import annotations

import random


class RandomSources:
    def __init__(self, rng: random.Random | None = None) -> None:
        self._base = (rng or random.Random()).getrandbits(64)

    def for_(self, part: str) -> random.Random:
        """The source of `part`: the same on every call, different for every other name."""
        return random.Random(f"{self._base}/{part}")
