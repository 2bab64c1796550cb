"""Executors run one work item. Each must be idempotent on the item's idempotency key.

Leases make delivery at-least-once (an agent killed after executing but before acking
gets the item again), so exactly-once execution is the executor's job: the recording
executor inserts the key into a SQLite journal in the same transaction that records the
execution, and a redelivered key is recognised and only acknowledged. (In a cluster the
Pod executor gets the same property from a deterministic Pod name.)
"""

from __future__ import annotations

import json
import sqlite3
import threading
from enum import StrEnum
from pathlib import Path
from typing import Protocol

from gpu_agent.foundations.clock import Clock, SystemClock
from gpu_agent.foundations.control_plane_client import WorkItem
from gpu_agent.foundations.fencing import LeaderToken
from gpu_agent.foundations.files import open_database
from gpu_agent.foundations.threads import in_daemon_thread


class AttemptNotMade(Exception):
    """The executor could not make its attempt for reasons of the infrastructure, not of the item (the
    API server did not answer, this agent's leadership was fenced): the item goes back without counting
    an attempt, so that an outage never turns runnable items into failed ones."""


class WorkPathRefused(AttemptNotMade):
    """The API server refused the item's Pod for a reason that is not the item's: the fencing policy, a quota,
    a missing ServiceAccount, an admission webhook that refuses every Pod. Every other item would be refused
    the same way, so the consumer stops leasing, proves the path again (`Executor.probe`) before it leases
    more, and says so in /healthz once it has lasted (queues NotReady with this reason)."""


class Outcome(StrEnum):
    """What running an item did; the value is the metrics' label."""
    EXECUTED = "executed"
    DUPLICATE = "duplicate"  # already run under this idempotency key: acknowledged only


class Executor(Protocol):
    """Executors are coroutines on the agent's event loop: they wait on the injected clock and run
    their blocking calls through the offload they were given, so one seeded simulation drives them."""

    async def execute(self, item: WorkItem, leader: LeaderToken | None = None) -> Outcome:
        """Run the item; EXECUTED, or DUPLICATE when it already ran under this key. `leader`: the
        fencing token of the leadership it runs under (None without leader election)."""
        ...

    async def after_ack(self, item: WorkItem) -> None:
        """Clean up once the control plane has the ack (e.g. delete the item's Pod)."""
        ...

    # Optional: `async probe(leader: LeaderToken | None) -> str` proves the work path without running anything
    # (a dry run): "" when an item's Pod would be admitted now (and, fenced, a stale token's refused), else why not.


class RecordingExecutor:
    def __init__(self, journal: Path, work_seconds: float = 0.0, clock: Clock | None = None) -> None:
        self.clock = clock or SystemClock()
        self._db = open_database(journal, "executor journal", "--executor-journal", """CREATE TABLE IF NOT EXISTS executions (
            idempotency_key TEXT PRIMARY KEY, item_id INTEGER NOT NULL, payload TEXT NOT NULL,
            executed_at REAL NOT NULL, deliveries INTEGER NOT NULL);""")
        self._lock = threading.Lock()
        self.work_seconds = work_seconds

    async def execute(self, item: WorkItem, leader: LeaderToken | None = None) -> Outcome:
        # The journal's reads and fsync'd writes run off the event loop, which keeps serving /healthz.
        if await in_daemon_thread(self._executed, item.idempotency_key):
            return Outcome.DUPLICATE
        if self.work_seconds:
            await self.clock.sleep(self.work_seconds)  # stands in for real work; a kill here must not lose the item
        return Outcome.EXECUTED if await in_daemon_thread(self._record, item, self.clock.wall()) else Outcome.DUPLICATE

    def _executed(self, key: str) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM executions WHERE idempotency_key = ?", (key,)).fetchone() is not None

    def _record(self, item: WorkItem, at: float) -> bool:
        """False when the key was recorded meanwhile."""
        with self._lock:
            try:
                self._db.execute("INSERT INTO executions VALUES (?, ?, ?, ?, ?)",
                                 (item.idempotency_key, item.item_id, json.dumps(item.payload, sort_keys=True),
                                  at, item.deliveries))
            except sqlite3.IntegrityError:
                return False
        return True

    async def after_ack(self, item: WorkItem) -> None:
        return None

    def executed_keys(self) -> list[str]:
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT idempotency_key FROM executions ORDER BY item_id")]

    def close(self) -> None:
        self._db.close()
