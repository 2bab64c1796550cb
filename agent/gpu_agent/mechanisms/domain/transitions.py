"""What changed between two written statuses of a GPUDomain, told as Events a person asks about.

The folder (aggregate.py) calls `transitions(before, after)` after each status write it made and
hands the result to the EventRecorder (foundations/events.py), which turns repeats into series and
rate-limits per object. Events follow the writes, not the member objects: a node that joins and
leaves between two writes was never in the domain, and nothing is told about it.

  NodeJoined     Normal   a node is in the status that was not: its index and clique
  NodeLeft       Normal   a node is no longer in the status (its member deleted, or it left the clique)
  NodeNotReady   Warning  a node turned NotReady: its heartbeat silent for how long, or it says so
  NodeUntrusted  Warning  the folder doubts a node's member (trust.py): why (its address is not its Pod's, ...);
                          told when the doubt appears or its reason changes, instead of that node's NodeNotReady
  NodeReady      Normal   a node turned Ready again
  NodeWaiting    Warning  a node waits for a place in a full clique
  DomainReady    Normal   the Ready condition turned True
  DomainNotReady Warning  the Ready condition turned False (its reason and message)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpu_agent.mechanisms.domain.conditions import find
from gpu_agent.mechanisms.domain.entries import GPUDomain, nodes_of, status_of


@dataclass(frozen=True)
class Transition:
    type: str  # Normal | Warning
    reason: str
    note: str


def _where(node: Mapping[str, object]) -> str:
    clique = node.get("clique")
    return f"index {node.get('index')}" + (f" in clique {clique}" if clique else "")


def transitions(before: GPUDomain | None, after: GPUDomain, silent_for: Mapping[str, float] | None = None,
                doubted: Mapping[str, str] | None = None, doubted_before: Mapping[str, str] | None = None) -> list[Transition]:
    """`silent_for`: node -> seconds since its heartbeat last changed, for nodes NotReady because it stopped;
    `doubted`: node -> why the folder doubts its member now, `doubted_before`: ... as last told."""
    silent_for = silent_for or {}
    doubted, doubted_before = doubted or {}, doubted_before or {}
    old = {n["name"]: n for n in nodes_of(before or {})}
    new = {n["name"]: n for n in nodes_of(after)}
    out: list[Transition] = []
    for name in sorted(set(new) - set(old)):
        node = new[name]
        state = "" if node.get("status") == "Ready" else " (NotReady)"
        out.append(Transition("Normal", "NodeJoined", f"node {name} joined at {_where(node)}{state}"))
    for name in sorted(set(old) - set(new)):
        out.append(Transition("Normal", "NodeLeft", f"node {name} left ({_where(old[name])})"))
    told = set()
    for name in sorted(set(new)):
        why = doubted.get(name)
        if why is not None and why != doubted_before.get(name):
            out.append(Transition("Warning", "NodeUntrusted", f"node {name} is NotReady: {why}"))
            told.add(name)
    for name in sorted(set(old) & set(new)):
        was, now = old[name].get("status"), new[name].get("status")
        if was == "Ready" and now != "Ready" and name in told:
            continue  # NodeUntrusted said why
        if was == "Ready" and now != "Ready":
            why = (f"no heartbeat for {silent_for[name]:.0f} s" if name in silent_for
                   else "its node agent reports it NotReady")
            out.append(Transition("Warning", "NodeNotReady", f"node {name} turned NotReady: {why}"))
        elif was != "Ready" and now == "Ready":
            out.append(Transition("Normal", "NodeReady", f"node {name} is Ready again"))
    waiting_before = {(c.get("id", ""), n) for c in status_of(before or {}).get("cliques") or [] for n in c.get("waiting") or []}
    for clique in status_of(after).get("cliques") or []:
        for name in clique.get("waiting") or []:
            if (clique.get("id", ""), name) not in waiting_before:
                out.append(Transition("Warning", "NodeWaiting",
                                      f"node {name} waits for a place in clique {clique.get('id') or '(none)'}: it is full"))
    was_ready = find(status_of(before or {}).get("conditions"))
    is_ready = find(status_of(after).get("conditions"))
    if is_ready is not None and (was_ready is None or was_ready.get("status") != is_ready.get("status")):
        if is_ready.get("status") == "True":
            out.append(Transition("Normal", "DomainReady", f"domain Ready: {is_ready.get('message', '')}"))
        elif was_ready is not None and was_ready.get("status") == "True":
            out.append(Transition("Warning", "DomainNotReady",
                                  f"domain NotReady ({is_ready.get('reason', '')}): {is_ready.get('message', '')}"))
    return out
