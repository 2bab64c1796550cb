"""GPUDomainMember names, and the aggregator's index of one domain's members.

A member's name is a function of (domain, node) that the chart's ValidatingAdmissionPolicy
(templates/validatingadmissionpolicy-members.yaml) computes again in CEL, which has no hash
function: so the name is `<domain>.<node>`, which is injective because a domain name holds no
dot (the GPUDomain CRD refuses a new one that is not a DNS label, and the policy refuses a
member of a domain whose name holds one). Only when that passes the 253 characters an object
name may have is it cut, with a hash of the pair after the cut; see member_name for what the
policy can then bind.

0.1 (and 0.2's builds before issue 24) named members `<domain>-<node>`, which two pairs can share
("train", "rack1-n1") and ("train-rack1", "n1"). Upgrading, both names exist for one node for a
while: an old node agent keeps renewing its legacy member until its Pod is replaced (a member that
Pod owns goes with it; 0.1's own none), and a new one applies its canonical member and, at its
first heartbeat (not at the join, which a forming domain waits on), deletes its own legacy one
(MemberWriter). The policy lets a node agent change or delete, never create, its own node's
legacy member. MemberIndex keys the objects by name, so the legacy member's
DELETED event cannot drop the node while its canonical member stands, and prefers the canonical
member when both are there.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from typing import Any, cast

from gpu_agent.foundations.klog import get_logger
from gpu_agent.mechanisms.domain.entries import MemberSpec

log = get_logger(__name__)

MAX_NAME = 253  # an object name is a DNS subdomain
HASHED_PREFIX = 242  # a cut name: this much of "<domain>.<node>", "-", ten hex digits of the hash
DOMAIN_LABEL = "gpu-agent.io/domain"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
Owner = tuple[str, str]  # (name, uid) of a member's owner Pod


def member_name(domain: str, node: str) -> str:
    """The member of `node` in `domain`: `<domain>.<node>`, unique for domains whose name holds no dot.

    Past 253 characters: the first 242 characters of that (less a dot it may end with, which would
    leave the next label starting with "-"), "-" and the first ten hex digits of
    sha256(domain NUL node). The policy can bind only the cut prefix of such a name (it cannot hash),
    so the agent of a node whose name shares its first 242 - len(domain) - 1 characters with another
    node's (both longer than that) can create the other's member name first. It gains nothing but a
    denial: the aggregator leaves that object out (its name is not the hash of its own node), and the
    other node's agent cannot write its member while it stands. Node names that long, and alike, are
    ones the cluster's administrator chose.
    """
    joined = f"{domain}.{node}"
    if len(joined) <= MAX_NAME:
        return joined
    prefix = joined[:HASHED_PREFIX]
    prefix = prefix[:-1] if prefix.endswith(".") else prefix
    digest = hashlib.sha256(f"{domain}\0{node}".encode()).hexdigest()[:10]
    return f"{prefix}-{digest}"


def legacy_member_name(domain: str, node: str) -> str:
    """0.1's name for the same member, for the upgrade (not unique: see the module docstring)."""
    return f"{domain}-{node}"[:MAX_NAME]


def domain_name_problem(domain: str) -> str | None:
    """Why node agents cannot write members of this domain, or None: its name must be a DNS label."""
    if len(domain) <= 63 and DNS_LABEL.match(domain):
        return None
    return (f"its name {domain!r} is not a DNS label (lowercase letters, digits and '-', at most 63 characters), "
            "so the member names <domain>.<node> would not be unique; recreate the GPUDomain under such a name")


def owner_of(obj: Any) -> Owner | None:
    """The Pod a member names as its owner (its first Pod ownerReference: the node agent's own Pod), or None."""
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    refs = meta.get("ownerReferences") if isinstance(meta, dict) else None
    for ref in refs if isinstance(refs, list) else []:
        if isinstance(ref, dict) and ref.get("kind") == "Pod" and ref.get("apiVersion") == "v1":
            return str(ref.get("name") or ""), str(ref.get("uid") or "")
    return None


class MemberIndex:
    """The readable members of one domain, by object name; `members()` gives one spec per node.

    Left out (and logged once per object name, however often it changes, until it is deleted or
    turns readable): an object that is not a member of this domain (spec.domain or the domain label
    another's), has no readable spec (spec or spec.node missing: objects from before the CRD
    required them), or whose name is neither the canonical nor the legacy name of its own
    (spec.domain, spec.node) (a member written under another node's name)."""

    def __init__(self, domain: str, where: str) -> None:
        self.domain = domain
        self.where = where
        self.objects: dict[str, MemberSpec] = {}
        self.owners: dict[str, Owner | None] = {}  # object name -> the owner Pod it names (trust.py checks it)
        self.names: dict[str, set[str]] = {}  # node -> the names of its objects (two during an upgrade)
        self.logged: set[str] = set()

    def _read(self, obj: Any) -> tuple[str, MemberSpec | None]:
        """The object's name and spec, or its name (or "?") and None, logged, when it is left out."""
        name = self._name(obj)
        why = self._problem(obj, name)
        if why is None:
            self.logged.discard(name)
            return name, cast(MemberSpec, obj["spec"])  # the API server checked it against the CRD's schema
        if name not in self.logged:
            self.logged.add(name)
            log.warning("member %s of %s left out of the fold: %s", name, self.where, why)
        return name, None

    def _problem(self, obj: Any, name: str) -> str | None:
        spec = obj.get("spec") if isinstance(obj, dict) else None
        if not isinstance(spec, dict) or not isinstance(spec.get("node"), str) or not spec["node"]:
            return "it has no spec.node"
        domain, node = spec.get("domain"), spec["node"]
        meta = obj.get("metadata")
        labels = meta.get("labels") if isinstance(meta, dict) else None
        labels = labels if isinstance(labels, dict) else {}
        if domain != self.domain or labels.get(DOMAIN_LABEL) != self.domain:
            return f"spec.domain {domain!r} and label {DOMAIN_LABEL}={labels.get(DOMAIN_LABEL)!r} are not both {self.domain!r}"
        if name not in (member_name(domain, node), legacy_member_name(domain, node)):
            return f"its name is not {member_name(domain, node)!r}, the member name of node {node!r}"
        return None

    def replace(self, objects: Iterable[Any]) -> None:
        """A relist: these objects are all there is."""
        self.objects, self.owners, self.names = {}, {}, {}
        for obj in objects:
            self._set(*self._read(obj), owner_of(obj))

    def event(self, kind: str, obj: Any) -> set[str]:
        """A watch event; the nodes whose member it may have changed (see member())."""
        name = self._name(obj)
        before = self.objects.get(name)
        spec = self._read(obj)[1] if kind != "DELETED" else None
        if kind == "DELETED":
            self.logged.discard(name)
        self._set(name, spec, owner_of(obj))
        return {s["node"] for s in (before, spec) if s is not None}

    def _set(self, name: str, spec: MemberSpec | None, owner: Owner | None = None) -> None:
        old = self.objects.pop(name, None)
        self.owners.pop(name, None)
        if old is not None:
            names = self.names[old["node"]]
            names.discard(name)
            if not names:
                del self.names[old["node"]]
        if spec is not None:
            self.objects[name] = spec
            self.owners[name] = owner
            self.names.setdefault(spec["node"], set()).add(name)

    @staticmethod
    def _name(obj: Any) -> str:
        meta = obj.get("metadata") if isinstance(obj, dict) else None
        name = meta.get("name") if isinstance(meta, dict) else None
        return name if isinstance(name, str) and name else "?"

    def _chosen(self, node: str) -> str | None:
        """The name of the node's object member() reads: its canonical member's where it has both (an upgrade)."""
        names = self.names.get(node)
        if not names:
            return None
        canonical = member_name(self.domain, node)
        return canonical if canonical in names else min(names)

    def member(self, node: str) -> MemberSpec | None:
        """The node's spec: its canonical member's where it has both (an upgrade in progress)."""
        name = self._chosen(node)
        return None if name is None else self.objects[name]

    def owner(self, node: str) -> Owner | None:
        """The owner Pod that the object member() reads names (None: it names none, or the node has no member)."""
        name = self._chosen(node)
        return None if name is None else self.owners.get(name)

    def is_legacy(self, node: str) -> bool:
        """The object member() reads is 0.1's, named `<domain>-<node>` (0.1's node agents name no owner Pod)."""
        name = self._chosen(node)
        return name is not None and name != member_name(self.domain, node)

    def members(self) -> dict[str, MemberSpec]:
        """node -> spec, as member() gives it."""
        return {node: spec for node in sorted(self.names) if (spec := self.member(node)) is not None}
