"""A GPUDomain's `Ready` condition: what `kubectl wait`, kstatus (Flux, Helm 4's --wait) and Argo CD read.

The Kubernetes API conventions' shape (metav1.Condition): type, status True|False|Unknown, a
CamelCase reason a program can branch on, a message a person reads, the generation it was computed
from, and lastTransitionTime, which moves only when `status` moves (as meta.SetStatusCondition does),
so a message that changes while the domain stays NotReady is no transition.

One condition, `Ready`, with these reasons, decided in this order:

  Initializing     Unknown  no member has joined yet and the domain was never folded before
  MembersReady     True     at least spec.expectedNodes members are Ready
  CliqueFull       False    a node waits for a place in a full clique (spec.maxNodesPerClique)
  MembersMissing   False    fewer members joined than expected (forming, or a node left)
  MembersNotReady  False    enough joined, but some are NotReady (heartbeat silent, the node says so, or the
                            folder doubts what it says: trust.py)

kstatus reads Ready=True as Current and False/Unknown as InProgress; with status.observedGeneration
it also reads a spec change the folder has not yet answered as InProgress. There are no
Reconciling/Stalled conditions: a domain waiting for nodes is not a controller stuck, and nothing
here can tell a node that will come from one that never will.

Pure functions: the folder (aggregate.py) and the optimistic writers (entries.py) both call them.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from typing import Any, TypedDict, cast

READY = "Ready"
MESSAGE_LIMIT = 1024  # bytes; a condition's message is for people, and 1,000 node names are not


class Condition(TypedDict, total=False):
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str
    observedGeneration: int
    lastTransitionTime: str


def timestamp(wall: float) -> str:
    """metav1.Time: RFC 3339 in UTC, whole seconds."""
    return dt.datetime.fromtimestamp(wall, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def names(nodes: Iterable[str], limit: int = 10) -> str:
    """`a, b, c` or `a, b, ... and 7 more`: a message names nodes without growing with the domain."""
    listed = sorted(nodes)
    shown = ", ".join(listed[:limit])
    return shown if len(listed) <= limit else f"{shown} and {len(listed) - limit} more"


def _cap(message: str) -> str:
    raw = message.encode()
    return message if len(raw) <= MESSAGE_LIMIT else raw[:MESSAGE_LIMIT - 3].decode(errors="ignore") + "..."


def untrusted(doubted: Mapping[str, str], nodes: Iterable[str], limit: int = 3) -> str:
    """`a (why); b (why) and 2 more`: the doubted nodes with their reasons, a bounded number of them."""
    listed = sorted(nodes)
    shown = "; ".join(f"{n} ({doubted[n]})" for n in listed[:limit])
    return shown if len(listed) <= limit else f"{shown} and {len(listed) - limit} more"


def ready_condition(*, expected: int, joined: Mapping[str, bool], waiting: Mapping[str, list[str]],
                    silent: Iterable[str] = (), limit: int | None = None,
                    previous: Condition | None = None, doubted: Mapping[str, str] | None = None) -> tuple[str, str, str]:
    """(status, reason, message) of the Ready condition.

    `joined`: node -> Ready for every node in the status; `waiting`: clique -> nodes without a place;
    `silent`: nodes NotReady because their heartbeat stopped (named as such); `doubted`: node -> why the folder
    does not trust its member (trust.py), named with the reason; `previous`: the Ready condition already written
    (Initializing holds only until something has been folded)."""
    ready = sorted(n for n, r in joined.items() if r)
    not_ready = sorted(n for n, r in joined.items() if not r)
    silent = set(silent)
    doubted = doubted or {}
    if not joined and not waiting and (previous is None or previous.get("reason") == "Initializing"):
        return "Unknown", "Initializing", f"no node has joined yet ({expected} expected)"
    if expected > 0 and len(ready) >= expected:
        extra = f" ({len(joined)} joined)" if len(joined) > expected else ""
        return "True", "MembersReady", f"{len(ready)} of {expected} expected nodes Ready{extra}"
    parts = []
    if not_ready:
        doubts = [n for n in not_ready if n in doubted]
        quiet = [n for n in not_ready if n in silent and n not in doubted]
        said = [n for n in not_ready if n not in silent and n not in doubted]
        if said:
            parts.append(f"NotReady: {names(said)}")
        if quiet:
            parts.append(f"no heartbeat: {names(quiet)}")
        if doubts:
            parts.append(f"untrusted: {untrusted(doubted, doubts)}")
    if waiting:
        blocked = [f"{names(nodes)} wait for a place in clique {clique or '(none)'}" for clique, nodes in sorted(waiting.items())]
        where = f" (maxNodesPerClique {limit})" if limit else ""
        return "False", "CliqueFull", "; ".join([*blocked, *parts]) + where
    if len(joined) < expected:
        return "False", "MembersMissing", "; ".join([f"{len(joined)} of {expected} expected nodes joined", *parts])
    if expected <= 0:
        return "False", "MembersMissing", "spec.expectedNodes is 0: set it to the number of nodes the domain needs"
    return "False", "MembersNotReady", "; ".join([f"{len(ready)} of {expected} expected nodes Ready", *parts])


def find(conditions: Iterable[Mapping[str, Any]] | None, kind: str = READY) -> Condition | None:
    for c in conditions or []:
        if isinstance(c, Mapping) and c.get("type") == kind:
            return cast(Condition, dict(c))
    return None


def set_condition(conditions: list[Condition] | None, kind: str, status: str, reason: str, message: str,
                  generation: int | None, now: str) -> list[Condition]:
    """`conditions` with `kind` set; lastTransitionTime kept unless its status moves; others untouched."""
    old = find(conditions, kind)
    new: Condition = {"type": kind, "status": status, "reason": reason, "message": _cap(message),
                      "lastTransitionTime": old["lastTransitionTime"] if old and old.get("status") == status
                      and old.get("lastTransitionTime") else now}
    if generation is not None:
        new["observedGeneration"] = generation
    return [*(c for c in conditions or [] if c.get("type") != kind), new]


def generation_of(obj: Mapping[str, Any]) -> int | None:
    generation = (obj.get("metadata") or {}).get("generation")
    return generation if isinstance(generation, int) and not isinstance(generation, bool) else None
