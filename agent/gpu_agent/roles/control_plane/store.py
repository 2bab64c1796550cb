"""SQLite persistence for the reference control plane; survives a restart.

Credentials are stored as SHA-256 hashes only: a copy of the database holds no usable
token. Leasing is one IMMEDIATE transaction, so two consumers never get the same item,
and an item whose lease has expired is simply eligible again (redelivery).

Fencing: a consumer that becomes the active agent starts a term (`start_term`), numbered one
higher than any before. Starting a term hands back every lease taken under an older term (those
items are queued again at once: the new agent adopts them), and from then on a lease, ack,
renewal or release that names an older term, or names none, is refused (`Fenced`). An agent
that lost its leadership while partitioned can therefore neither take nor finish work once its
successor has begun. Each delivery is logged with its holder and term (`deliveries`), the
record the failover tests read instead of the agents' own journals.

Poison items: a consumer whose executor failed releases the item with the error. That counts an
attempt and holds the item back (`not_before`) for a capped, jittered backoff, during which
leases pass over it to the items behind it: one item that cannot run never stops the queue.
After `max_attempts` failed attempts the item is `failed`, with the last error as its reason, and
is never delivered again. A lease that merely expires (its consumer died) or a release without an
error (a paused queue giving it back) counts no attempt.

Cluster identity: a cluster may have its own registration token (`issue_cluster_token`, through the admin route),
stored as a hash beside its clusterId. Once that token has been used, the cluster is registered and deregistered
with it alone: the shared registration token and every other cluster's token are refused for it (`admit`). A new
token takes over at its first use; until then what the cluster used before (the shared token, or its previous own
token) still works, so that the Secret the cluster's agent reads can be updated without a moment refused.

Credential chains: a registration that names its holder (the agent's identity) and every renewal of a credential it
got retire the holder's earlier credentials of that cluster: the newest of them keeps working for the overlap, the
older ones stop at once. One agent therefore holds at most two valid credentials at a time. A credential's holder is
kept in a table of its own (`credential_holders`): 0.1.0 inserts into `credentials` by position (three values).
"""

from __future__ import annotations

import hashlib
import json
import random
import secrets
import threading
import time
from pathlib import Path
from typing import Any

from gpu_agent.foundations.backoff import Backoff
from gpu_agent.foundations.files import open_database

SCHEMA = """
CREATE TABLE IF NOT EXISTS registrations (
    cluster_id TEXT PRIMARY KEY, registration_id TEXT NOT NULL, generation INTEGER NOT NULL,
    gpus TEXT NOT NULL, registered_at REAL NOT NULL, count INTEGER NOT NULL DEFAULT 1);
CREATE TABLE IF NOT EXISTS credentials (
    token_sha256 TEXT PRIMARY KEY, cluster_id TEXT NOT NULL, expires_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS items (
    id INTEGER PRIMARY KEY AUTOINCREMENT, idempotency_key TEXT NOT NULL UNIQUE, payload TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'queued', lease_id TEXT, lease_expires_at REAL,
    deliveries INTEGER NOT NULL DEFAULT 0, created_at REAL NOT NULL, acked_at REAL);
CREATE TABLE IF NOT EXISTS terms (
    term INTEGER PRIMARY KEY AUTOINCREMENT, holder TEXT NOT NULL, started_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS deliveries (
    id INTEGER PRIMARY KEY AUTOINCREMENT, item_id INTEGER NOT NULL, holder TEXT, term INTEGER, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS registration_gpu_counts (
    registration_id TEXT PRIMARY KEY, gpu_count INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS credential_holders (
    token_sha256 TEXT PRIMARY KEY, cluster_id TEXT NOT NULL, holder TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS cluster_tokens (
    cluster_id TEXT PRIMARY KEY, token_sha256 TEXT NOT NULL UNIQUE, before_sha256 TEXT,
    in_use INTEGER NOT NULL DEFAULT 0, issued_at REAL NOT NULL);
"""
# cluster_tokens: `token_sha256` is the cluster's own registration token; until it is used (`in_use` 0) the token
# the cluster used before it is still accepted: `before_sha256`, or the shared registration token when that is NULL.
# registration_gpu_counts: a cluster's whole GPU count where its registration lists only the first MAX_GPUS. A table
# of its own, keyed by the registration, not a column of `registrations`: 0.1.0 inserts into `registrations` by
# position (six values), so a seventh column there would fail every registration after a downgrade; and a
# registration 0.1.0 makes has a new id, so no count of an earlier one is ever read for it.
# The lease query reads only items still to run; done and failed ones pile up and are never read by it.
# Made after ADDED_COLUMNS (a database of 0.1.0 gains them first).
INDEXES = """
CREATE INDEX IF NOT EXISTS items_open ON items(id) WHERE state IN ('queued', 'leased');
CREATE INDEX IF NOT EXISTS credential_chains ON credential_holders(cluster_id, holder);
"""
# Columns added after 0.1.0; a database written by 0.1.0 gains them when it is opened.
ADDED_COLUMNS = {"items": [("lease_holder", "TEXT"), ("lease_term", "INTEGER"), ("attempts", "INTEGER NOT NULL DEFAULT 0"),
                           ("not_before", "REAL"), ("last_error", "TEXT")]}
# The due items in queue order. `state IN (...)` lets the partial index items_open serve it: the done and
# failed items, which pile up, are never scanned.
LEASE_QUERY = """SELECT id, idempotency_key, payload, deliveries FROM items
    WHERE state IN ('queued', 'leased') AND ((state = 'queued' AND COALESCE(not_before, 0) <= ?)
    OR (state = 'leased' AND lease_expires_at <= ?)) ORDER BY id LIMIT ?"""
MAX_ERROR_CHARS = 1000
DELIVERY_LOG_LIMIT = 10000


class Fenced(Exception):
    """The request names an older term than the current one, or none while terms are in use."""

    def __init__(self, term: int, holder: str) -> None:
        super().__init__(f"fenced: term {term} (holder {holder}) is the current term; "
                         "a consumer must start a term (POST /v1/queue/terms) and name it")
        self.term = term
        self.holder = holder


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Store:
    def __init__(self, path: Path, clock: Any = time.time, *, rng: random.Random | None = None, max_attempts: int = 5,
                 retry_base_seconds: float = 1.0, retry_max_seconds: float = 60.0) -> None:
        self.rng = rng or random.Random()
        self.max_attempts = max_attempts
        self.retry_base_seconds = retry_base_seconds
        self.retry_max_seconds = retry_max_seconds
        self._db = open_database(path, "control-plane database", "--database", SCHEMA)
        # SQLite's own temporary files (statement journals, sorts) in memory: the chart's control plane pod has a
        # read-only root filesystem and no writable temp folder, only the database's volume.
        self._db.execute("PRAGMA temp_store=MEMORY")
        for table, columns in ADDED_COLUMNS.items():
            have = {r[1] for r in self._db.execute(f"PRAGMA table_info({table})")}
            for name, kind in columns:
                if name not in have:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")
        self._db.executescript(INDEXES)
        self._lock = threading.Lock()
        self._now = clock
        self._queue_changed = threading.Condition()
        self._closing = False

    def release_waiters(self) -> None:
        """Long-polled lease calls return at once (empty) instead of holding shutdown for their wait."""
        self._closing = True
        self._notify()

    def close(self) -> None:
        self.release_waiters()
        with self._lock:
            self._db.close()

    # credentials ---------------------------------------------------------------------------
    def issue_credential(self, cluster_id: str, ttl: float, holder: str | None = None,
                         overlap: float = 0.0) -> tuple[str, float]:
        """A new credential of `cluster_id`. With `holder`, the holder's earlier credentials of the cluster are
        retired: the newest keeps working `overlap` seconds more (or to its own expiry, if sooner), the others stop
        now. Without, none is (a client of before holders)."""
        with self._lock:
            return self._issue(cluster_id, ttl, holder, overlap)

    def _issue(self, cluster_id: str, ttl: float, holder: str | None, overlap: float) -> tuple[str, float]:
        token = secrets.token_urlsafe(32)
        now = self._now()
        expires_at = now + ttl
        self._db.execute("DELETE FROM credentials WHERE expires_at < ?", (now - 3600,))
        self._db.execute("DELETE FROM credential_holders WHERE token_sha256 NOT IN (SELECT token_sha256 FROM credentials)")
        if holder is not None:
            earlier = [r[0] for r in self._db.execute(
                """SELECT c.token_sha256 FROM credentials c JOIN credential_holders h ON h.token_sha256 = c.token_sha256
                WHERE h.cluster_id = ? AND h.holder = ? AND c.expires_at > ? ORDER BY h.rowid DESC""",
                (cluster_id, holder, now))]
            for i, digest in enumerate(earlier):
                self._db.execute("UPDATE credentials SET expires_at = MIN(expires_at, ?) WHERE token_sha256 = ?",
                                 (now + overlap if i == 0 else now, digest))
            self._db.execute("INSERT INTO credential_holders VALUES (?, ?, ?)", (token_hash(token), cluster_id, holder))
        self._db.execute("INSERT INTO credentials VALUES (?, ?, ?)", (token_hash(token), cluster_id, expires_at))
        return token, expires_at

    def renew_credential(self, token: str, ttl: float, overlap: float) -> tuple[str, str, float]:
        """(cluster_id, the new credential, its expiry) for a valid `token`, which is retired: with the holder its
        registration named, as `issue_credential` retires a holder's; without, it alone keeps working `overlap`
        seconds more. KeyError if `token` is not a known credential."""
        digest = token_hash(token)
        with self._lock:
            row = self._db.execute("""SELECT c.cluster_id, h.holder FROM credentials c LEFT JOIN credential_holders h
                ON h.token_sha256 = c.token_sha256 WHERE c.token_sha256 = ?""", (digest,)).fetchone()
            if row is None:
                raise KeyError("unknown credential")
            cluster_id, holder = row
            fresh, expires_at = self._issue(cluster_id, ttl, holder, overlap)
            if holder is None:
                self._db.execute("UPDATE credentials SET expires_at = MIN(expires_at, ?) WHERE token_sha256 = ?",
                                 (self._now() + overlap, digest))
        return cluster_id, fresh, expires_at

    def credential_status(self, token: str) -> tuple[str | None, str]:
        """(cluster_id, "valid" | "expired" | "unknown")"""
        with self._lock:
            row = self._db.execute("SELECT cluster_id, expires_at FROM credentials WHERE token_sha256 = ?",
                                   (token_hash(token),)).fetchone()
        if row is None:
            return None, "unknown"
        return row[0], "valid" if row[1] > self._now() else "expired"

    def valid_credentials(self, cluster_id: str) -> int:
        """How many credentials of the cluster work now."""
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM credentials WHERE cluster_id = ? AND expires_at > ?",
                                        (cluster_id, self._now())).fetchone()[0])

    # cluster identity ----------------------------------------------------------------------
    def issue_cluster_token(self, cluster_id: str) -> tuple[str, bool]:
        """(a new registration token of the cluster's own, whether it replaces one). It takes over at its first use:
        until then the token the cluster used before still works (see the module's docstring)."""
        token = secrets.token_urlsafe(32)
        with self._lock:
            row = self._db.execute("SELECT token_sha256, in_use FROM cluster_tokens WHERE cluster_id = ?",
                                   (cluster_id,)).fetchone()
            if row is None:
                self._db.execute("INSERT INTO cluster_tokens VALUES (?, ?, NULL, 0, ?)",
                                 (cluster_id, token_hash(token), self._now()))
            elif row[1]:  # the one in use is what the cluster used before the new one
                self._db.execute("""UPDATE cluster_tokens SET token_sha256 = ?, before_sha256 = token_sha256, in_use = 0,
                    issued_at = ? WHERE cluster_id = ?""", (token_hash(token), self._now(), cluster_id))
            else:  # one never used is simply replaced: what came before it still works
                self._db.execute("UPDATE cluster_tokens SET token_sha256 = ?, issued_at = ? WHERE cluster_id = ?",
                                 (token_hash(token), self._now(), cluster_id))
        return token, row is not None

    def reset_cluster_token(self, cluster_id: str) -> bool:
        """Forget the cluster's own token: the shared registration token registers and deregisters it again."""
        with self._lock:
            return bool(self._db.execute("DELETE FROM cluster_tokens WHERE cluster_id = ?", (cluster_id,)).rowcount)

    def _token_owner(self, digest: str) -> str | None:
        row = self._db.execute("""SELECT cluster_id FROM cluster_tokens WHERE token_sha256 = ?
            OR (before_sha256 = ? AND in_use = 0)""", (digest, digest)).fetchone()
        return row[0] if row else None

    def cluster_of_token(self, token: str) -> str | None:
        """The cluster whose own registration token this is (or, until its successor is used, was); None if none."""
        with self._lock:
            return self._token_owner(token_hash(token))

    def admit(self, cluster_id: str, token: str, shared: bool) -> tuple[str, str] | None:
        """None when `token` may register or deregister `cluster_id` (the first use of the cluster's new token binds
        it to that token), else why not: ("own-token", "") when the cluster has a token of its own and this is not
        it, ("other-cluster", owner) when this is another cluster's token. `shared`: `token` is the shared one."""
        digest = token_hash(token)
        with self._lock:
            row = self._db.execute("SELECT token_sha256, before_sha256, in_use FROM cluster_tokens WHERE cluster_id = ?",
                                   (cluster_id,)).fetchone()
            if row is None:
                if shared:
                    return None
            elif digest == row[0]:
                if not row[2]:
                    self._db.execute("UPDATE cluster_tokens SET in_use = 1, before_sha256 = NULL WHERE cluster_id = ?",
                                     (cluster_id,))
                return None
            elif not row[2] and (digest == row[1] or (row[1] is None and shared)):
                return None
            owner = None if shared else self._token_owner(digest)
        if owner is not None and owner != cluster_id:
            return "other-cluster", owner
        return "own-token", ""

    # registrations -------------------------------------------------------------------------
    def register(self, cluster_id: str, generation: int, gpus: list[dict[str, Any]] | str, gpu_count: int | None = None) -> str:
        """`gpus`: the GPU list, or its JSON. `gpu_count`: the cluster's whole count (None: as many as listed)."""
        registration_id = "reg-" + secrets.token_hex(8)
        text = gpus if isinstance(gpus, str) else json.dumps(gpus)
        with self._lock:  # a crash between the two leaves no count: the list's length is reported, as 0.1 does
            self._forget_count(cluster_id)
            self._db.execute("""INSERT INTO registrations
                (cluster_id, registration_id, generation, gpus, registered_at, count) VALUES (?, ?, ?, ?, ?, 1)
                ON CONFLICT(cluster_id) DO UPDATE SET registration_id=excluded.registration_id,
                generation=excluded.generation, gpus=excluded.gpus, registered_at=excluded.registered_at,
                count=registrations.count + 1""",
                             (cluster_id, registration_id, generation, text, self._now()))
            if gpu_count is not None:
                self._db.execute("INSERT INTO registration_gpu_counts VALUES (?, ?)", (registration_id, gpu_count))
        return registration_id

    def _forget_count(self, cluster_id: str) -> None:
        self._db.execute("""DELETE FROM registration_gpu_counts WHERE registration_id IN
            (SELECT registration_id FROM registrations WHERE cluster_id = ?)""", (cluster_id,))

    def deregister(self, cluster_id: str) -> bool:
        with self._lock:
            self._forget_count(cluster_id)
            cur = self._db.execute("DELETE FROM registrations WHERE cluster_id = ?", (cluster_id,))
            self._db.execute("DELETE FROM credentials WHERE cluster_id = ?", (cluster_id,))
            self._db.execute("DELETE FROM credential_holders WHERE cluster_id = ?", (cluster_id,))
        return bool(cur.rowcount)

    # queue ---------------------------------------------------------------------------------
    def enqueue(self, key: str, payload: dict[str, Any]) -> tuple[int, bool]:
        """(id, created): an existing key returns its item unchanged."""
        with self._lock:
            row = self._db.execute("SELECT id FROM items WHERE idempotency_key = ?", (key,)).fetchone()
            if row:
                return row[0], False
            cur = self._db.execute("INSERT INTO items (idempotency_key, payload, created_at) VALUES (?, ?, ?)",
                                   (key, json.dumps(payload), self._now()))
        self._notify()
        assert cur.lastrowid is not None  # an INSERT's row
        return cur.lastrowid, True

    def _notify(self) -> None:
        with self._queue_changed:
            self._queue_changed.notify_all()

    # fencing -------------------------------------------------------------------------------
    def start_term(self, holder: str) -> tuple[int, int]:
        """(the new term, how many leases of older terms were handed back)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                term = self._db.execute("INSERT INTO terms (holder, started_at) VALUES (?, ?)",
                                        (holder, self._now())).lastrowid
                assert term is not None  # an INSERT's row
                released = self._db.execute("""UPDATE items SET state='queued', lease_id=NULL, lease_expires_at=NULL,
                    lease_holder=NULL, lease_term=NULL WHERE state='leased' AND (lease_term IS NULL OR lease_term < ?)""",
                                            (term,)).rowcount
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        self._notify()
        return term, released

    def current_term(self) -> tuple[int, str] | None:
        with self._lock:
            return self._current_term()

    def _current_term(self) -> tuple[int, str] | None:
        row = self._db.execute("SELECT term, holder FROM terms ORDER BY term DESC LIMIT 1").fetchone()
        return (int(row[0]), row[1]) if row else None

    def _check_term(self, term: int | None) -> None:
        """Raises Fenced unless `term` is the current term (or no term was ever started). Call under the lock."""
        current = self._current_term()
        if current is not None and term != current[0]:  # older, none, or one never started
            raise Fenced(*current)

    def delivery_log(self, limit: int) -> list[dict[str, Any]]:
        """The newest `limit` deliveries, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT id, item_id, holder, term, at FROM deliveries ORDER BY id DESC LIMIT ?",
                                    (limit,)).fetchall()
        return [{"id": r[0], "itemId": r[1], "holder": r[2], "term": r[3], "at": r[4]} for r in reversed(rows)]

    # queue (continued) -----------------------------------------------------------------------
    def lease_waiting(self, lease_seconds: float, wait_seconds: float, holder: str | None = None,
                      term: int | None = None, max_items: int = 1) -> list[dict[str, Any]]:
        """Long poll: lease up to `max_items` items, waiting up to `wait_seconds` for the first to appear
        (never for more: what is there is handed over at once). Idle consumers then cost one request per
        wait instead of one per poll interval."""
        deadline = time.monotonic() + wait_seconds
        while True:
            items = self.lease_many(lease_seconds, max_items, holder, term)
            remaining = deadline - time.monotonic()
            if items or remaining <= 0 or self._closing:
                return items
            with self._queue_changed:
                # Woken by enqueue/release/a new term; the 0.5 s bound also catches leases that expire.
                self._queue_changed.wait(min(remaining, 0.5))

    def lease(self, lease_seconds: float, holder: str | None = None, term: int | None = None) -> dict[str, Any] | None:
        """The next item, leased; None when none is due."""
        items = self.lease_many(lease_seconds, 1, holder, term)
        return items[0] if items else None

    def lease_many(self, lease_seconds: float, max_items: int, holder: str | None = None,
                   term: int | None = None) -> list[dict[str, Any]]:
        """Up to `max_items` due items in queue order, each under its own lease, in one transaction (a
        consumer filling several slots pays one fsync, not one per item)."""
        now = self._now()
        leased: list[dict[str, Any]] = []
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._check_term(term)
                rows = self._db.execute(LEASE_QUERY, (now, now, max_items)).fetchall()
                for row in rows:
                    lease_id = secrets.token_hex(8)
                    self._db.execute("""UPDATE items SET state='leased', lease_id=?, lease_expires_at=?,
                        deliveries=deliveries+1, lease_holder=?, lease_term=? WHERE id=?""",
                                     (lease_id, now + lease_seconds, holder, term, row[0]))
                    self._db.execute("INSERT INTO deliveries (item_id, holder, term, at) VALUES (?, ?, ?, ?)",
                                     (row[0], holder, term, now))
                    leased.append({"id": row[0], "idempotencyKey": row[1], "payload": json.loads(row[2]),
                                   "leaseId": lease_id, "deliveries": row[3] + 1, "leaseExpiresInSeconds": lease_seconds})
                if rows:
                    self._db.execute("DELETE FROM deliveries WHERE id <= (SELECT MAX(id) FROM deliveries) - ?",
                                     (DELIVERY_LOG_LIMIT,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return leased

    def ack(self, item_id: int, lease_id: str, term: int | None = None) -> str:
        """"acked", "already-acked", "stale-lease" or "unknown"; raises Fenced."""
        with self._lock:
            self._check_term(term)
            row = self._db.execute("SELECT state, lease_id FROM items WHERE id = ?", (item_id,)).fetchone()
            if row is None:
                return "unknown"
            if row[1] != lease_id:
                return "stale-lease"
            if row[0] == "done":
                return "already-acked"
            self._db.execute("UPDATE items SET state='done', acked_at=? WHERE id=?", (self._now(), item_id))
            return "acked"

    def renew(self, item_id: int, lease_id: str, lease_seconds: float, term: int | None = None) -> str:
        """"renewed", "stale-lease" (expired, replaced or acked) or "unknown". An expired lease is
        not revived: the item may already be on its way to another consumer."""
        now = self._now()
        with self._lock:
            self._check_term(term)
            cur = self._db.execute("""UPDATE items SET lease_expires_at=? WHERE id=? AND lease_id=? AND state='leased'
                AND lease_expires_at > ?""", (now + lease_seconds, item_id, lease_id, now))
            if cur.rowcount:
                return "renewed"
            known = self._db.execute("SELECT 1 FROM items WHERE id = ?", (item_id,)).fetchone()
        return "stale-lease" if known else "unknown"

    def retry_delay(self, attempts: int) -> float:
        """Before attempt `attempts` + 1: base * 2^(attempts-1), capped, then jittered down by up to half
        (so that items failing together do not come back together)."""
        return Backoff(self.retry_base_seconds, self.retry_max_seconds, jitter=0.5, rng=self.rng,
                       attempt=attempts - 1).next_delay()

    def release(self, item_id: int, lease_id: str, term: int | None = None, error: str | None = None) -> str:
        """"released", "retrying" (an attempt failed: back after a backoff), "failed" (its last attempt
        failed), "stale-lease" or "unknown"; raises Fenced."""
        now = self._now()
        with self._lock:
            self._check_term(term)
            row = self._db.execute("SELECT attempts FROM items WHERE id=? AND lease_id=? AND state='leased'",
                                   (item_id, lease_id)).fetchone()
            if row is None:
                known = self._db.execute("SELECT 1 FROM items WHERE id = ?", (item_id,)).fetchone()
                return "stale-lease" if known else "unknown"
            attempts, state, not_before, result = row[0], "queued", None, "released"
            if error is not None:
                attempts += 1
                if attempts >= self.max_attempts:
                    state, result = "failed", "failed"
                else:
                    not_before, result = now + self.retry_delay(attempts), "retrying"
            self._db.execute("""UPDATE items SET state=?, lease_id=NULL, lease_expires_at=NULL, lease_holder=NULL,
                lease_term=NULL, attempts=?, not_before=?, last_error=COALESCE(?, last_error) WHERE id=?""",
                             (state, attempts, not_before, None if error is None else error[:MAX_ERROR_CHARS], item_id))
        self._notify()
        return result

    def item_state(self, item_id: int) -> str | None:
        """"queued", "leased", "done" or "failed"; None when there is no such item."""
        with self._lock:
            row = self._db.execute("SELECT state FROM items WHERE id = ?", (item_id,)).fetchone()
        return row[0] if row else None

    def list_items(self, limit: int) -> list[dict[str, Any]]:
        """The newest `limit` items, oldest first: what `gpu-agent queue list` shows."""
        with self._lock:
            rows = self._db.execute("SELECT id, idempotency_key, state, deliveries, created_at, acked_at, attempts, "
                                    "last_error FROM items ORDER BY id DESC LIMIT ?", (limit,)).fetchall()
        return [{"id": r[0], "idempotencyKey": r[1], "state": r[2], "deliveries": r[3], "createdAt": r[4],
                 **({"ackedAt": r[5]} if r[5] is not None else {}), "failedAttempts": r[6],
                 **({"lastError": r[7]} if r[7] is not None else {})} for r in reversed(rows)]

    def status(self) -> dict[str, Any]:
        with self._lock:
            counts = dict(self._db.execute("SELECT state, COUNT(*) FROM items GROUP BY state").fetchall())
            deliveries = self._db.execute("SELECT COALESCE(SUM(deliveries), 0) FROM items").fetchone()[0]
            # json_array_length: a 16,384-GPU list is counted by SQLite, not decoded on every status call.
            regs = [{"clusterId": r[0], "registrationId": r[1], "generation": r[2], "gpuCount": max(r[5] or 0, r[3]),
                     "gpusListed": r[3], "registrations": r[4]}
                    for r in self._db.execute("SELECT r.cluster_id, r.registration_id, r.generation, "
                                              "json_array_length(r.gpus), r.count, c.gpu_count FROM registrations r "
                                              "LEFT JOIN registration_gpu_counts c ON c.registration_id = r.registration_id")]
            term = self._current_term()
        return {"items": {"queued": counts.get("queued", 0), "leased": counts.get("leased", 0), "done": counts.get("done", 0),
                          "failed": counts.get("failed", 0)},
                "deliveries": deliveries, "registrations": regs,
                **({"term": {"term": term[0], "holder": term[1]}} if term else {})}
