"""The plugin's checkpoint of prepared claims: what survives a restart of the node agent.

    (absent) ──prepare begins──> PrepareStarted ──work done──> PrepareCompleted ──unprepare──> (absent)
                                       │                                                          ▲
                                       └──unprepare, or found stale (claim gone or replaced)──> PrepareAborted ──TTL──┘

- PrepareStarted is written before any work, so a claim that failed half-way (or a plugin killed
  half-way) is known and can be undone; an error leaves it there on purpose.
- A prepare of a claim in PrepareCompleted hands back what it returned the first time (the kubelet
  retries, and calls again after its own restart).
- PrepareAborted makes a late prepare of that claim fail for good instead of preparing it again after
  its unprepare (NVIDIA's driver found that race: a retry outliving the kubelet's unprepare leaked
  its device). It is dropped after `ABORTED_TTL` seconds.
The file is replaced atomically on every change (foundations/files.py), so a reader sees one state or
the next, never half of one.
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpu_agent.foundations.files import write_atomic
from gpu_agent.foundations.klog import get_logger

log = get_logger(__name__)

PREPARE_STARTED = "PrepareStarted"
PREPARE_COMPLETED = "PrepareCompleted"
PREPARE_ABORTED = "PrepareAborted"
STATES = (PREPARE_STARTED, PREPARE_COMPLETED, PREPARE_ABORTED)
ABORTED_TTL = 90.0  # twice the kubelet's 45 s prepare deadline: no retry of an old call can still be running
VERSION = "gpu.gpu-agent.io/checkpoint/v1"


@dataclass
class Entry:
    uid: str
    namespace: str
    name: str
    state: str
    devices: list[dict[str, Any]] = field(default_factory=list)  # what prepare returned (PrepareCompleted)
    cdi_spec: str = ""  # the CDI spec file written for it
    since: float = 0.0  # wall-clock time of the last state change
    domain: str = ""  # a channel claim's GPUDomain: the node stays its member while the entry holds it


class Checkpoint:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = self._load()

    def _load(self) -> dict[str, Entry]:
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            # unreadable: keep it for a person to read, start empty (claims prepare again from their objects)
            broken = self.path.with_suffix(".broken")
            log.error("checkpoint %s cannot be read (%s): moved to %s, starting empty", self.path, e, broken)
            self.path.replace(broken)
            return {}
        entries = {}
        for item in raw.get("claims", []):
            try:
                entry = Entry(**{k: item[k] for k in Entry.__dataclass_fields__ if k in item})
            except TypeError as e:
                log.error("checkpoint %s: entry %r dropped (%s)", self.path, item, e)
                continue
            if entry.state in STATES:
                entries[entry.uid] = entry
        return entries

    def _save(self) -> None:
        body = {"version": VERSION, "claims": [asdict(e) for e in sorted(self._entries.values(), key=lambda e: e.uid)]}
        write_atomic(self.path, json.dumps(body, indent=1, sort_keys=True) + "\n")

    def get(self, uid: str) -> Entry | None:
        with self._lock:
            entry = self._entries.get(uid)
            return Entry(**asdict(entry)) if entry else None

    def entries(self) -> list[Entry]:
        with self._lock:
            return [Entry(**asdict(e)) for e in self._entries.values()]

    def put(self, entry: Entry) -> None:
        with self._lock:
            self._entries[entry.uid] = entry
            self._save()

    def drop(self, uid: str) -> None:
        with self._lock:
            if self._entries.pop(uid, None) is not None:
                self._save()

    def drop_expired_aborted(self, now: float) -> list[Entry]:
        with self._lock:
            gone = [e for e in self._entries.values() if e.state == PREPARE_ABORTED and now - e.since > ABORTED_TTL]
            for e in gone:
                del self._entries[e.uid]
            if gone:
                self._save()
            return gone
