"""The fold, simulated: a seeded stream of member events (joins, leaves, clique moves, readiness
changes, heartbeats that stop and resume, a domain limit per clique) folded step by step as the
aggregator folds them, on a virtual clock. After every step:

- no two entries of one clique share an index, and no clique holds more than its limit;
- the entries are exactly the members present (less those waiting for a place in a full clique);
- a member whose heartbeat has not changed for its TTL is NotReady, one that beat within it says
  what it says; the domain is Ready only with `expectedNodes` Ready entries;
- a member that stays put keeps its index (no reshuffle when another joins or leaves).
"""

from __future__ import annotations

import random
from typing import Any

from gpu_agent.mechanisms.domain.aggregate import HeartbeatTracker, fold

TTL_INTERVALS = 3.0


def run_fold_seed(seed: int, steps: int = 200) -> list[str]:
    rng = random.Random(seed)
    now = [0.0]
    tracker = HeartbeatTracker(TTL_INTERVALS, lambda: now[0])
    limit = rng.choice((None, 2, 4))
    expected = rng.randint(1, 6)
    obj: dict[str, Any] = {"metadata": {"name": "d"}, "spec": {"expectedNodes": expected,
                                                                **({"maxNodesPerClique": limit} if limit else {})},
                           "status": {}}
    members: dict[str, dict[str, Any]] = {}
    beats: dict[str, int] = {}
    stalled: set[str] = set()
    problems: list[str] = []
    nodes = [f"n{i}" for i in range(8)]
    cliques = ["", "c1", "c2"]
    for step in range(steps):
        now[0] += rng.uniform(0.05, 1.5)
        node = rng.choice(nodes)
        what = rng.choice(("join", "leave", "move", "ready", "stall", "resume", "beat", "beat", "beat"))
        if what == "join" and node not in members:
            members[node] = {"node": node, "ip": "", "ready": True, "gpuUUIDs": [], "clique": rng.choice(cliques),
                             "heartbeat": "0", "heartbeatIntervalSeconds": 1}
            beats[node] = 0
            tracker.saw(node, members[node])
        elif what == "leave" and node in members:
            del members[node]
            tracker.forget(node)
            stalled.discard(node)
        elif what == "move" and node in members:
            members[node] = {**members[node], "clique": rng.choice(cliques)}
        elif what == "ready" and node in members:
            members[node] = {**members[node], "ready": not members[node]["ready"]}
        elif what == "stall":
            stalled.add(node)
        elif what == "resume":
            stalled.discard(node)
        # every member not stalled beats each interval
        for n in members:
            if n not in stalled:
                beats[n] += 1
                members[n] = {**members[n], "heartbeat": str(beats[n])}
                tracker.saw(n, members[n])
        before = {n["name"]: (n.get("clique") or "", n["index"]) for n in obj["status"].get("nodes", [])}
        silent = tracker.silent(members)
        folded = fold(obj, members, silent)
        obj = folded if folded is not None else obj
        status = obj["status"]
        entries = status.get("nodes", [])
        where = f"seed {seed} step {step} ({what} {node})"
        seen: dict[tuple[str, int], str] = {}
        per_clique: dict[str, int] = {}
        for e in entries:
            key = (e.get("clique") or "", e["index"])
            if key in seen:
                problems.append(f"{where}: {e['name']} and {seen[key]} share index {key[1]} in clique {key[0]!r}")
            seen[key] = e["name"]
            per_clique[key[0]] = per_clique.get(key[0], 0) + 1
            if e["name"] not in members:
                problems.append(f"{where}: {e['name']} left but is still an entry")
                continue
            spec = members[e["name"]]
            if (e.get("clique") or "") != (spec.get("clique") or ""):
                problems.append(f"{where}: {e['name']} is in clique {e.get('clique')!r}, its member says {spec['clique']!r}")
            want = "Ready" if spec["ready"] and e["name"] not in silent else "NotReady"
            if e["status"] != want:
                problems.append(f"{where}: {e['name']} is {e['status']}, should be {want}")
            if e["name"] in before and before[e["name"]][0] == (e.get("clique") or "") and before[e["name"]][1] != e["index"]:
                problems.append(f"{where}: {e['name']} moved from index {before[e['name']][1]} to {e['index']}")
        for clique, count in per_clique.items():
            if limit is not None and count > limit:
                problems.append(f"{where}: clique {clique!r} holds {count} entries, its limit is {limit}")
        waiting = {n for c in status.get("cliques", []) for n in c.get("waiting", [])}
        missing = set(members) - {e["name"] for e in entries} - waiting
        if missing:
            problems.append(f"{where}: members {sorted(missing)} are neither entries nor waiting")
        for n in stalled & set(members):
            if now[0] - tracker.seen[n][1] > TTL_INTERVALS and n not in silent:
                problems.append(f"{where}: {n} silent for {now[0] - tracker.seen[n][1]:.1f}s but not marked NotReady")
        ready = sum(1 for e in entries if e["status"] == "Ready")
        if (status.get("status") == "Ready") != (ready >= expected):
            problems.append(f"{where}: domain {status.get('status')} with {ready} Ready of {expected} expected")
        if problems:
            break
    return problems
