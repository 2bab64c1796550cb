"""The leader's fencing token, as the API server checks it on every work Pod.

A leader learns that it lost the Lease only when it next reads it; a Pod create it sent just
before (stalled in a partition, paused with its process) can land after its successor has run
the same item, acked it and deleted its Pod, and so run the item a second time. The agent
cannot close that window itself: the resource has to check the token (Kleppmann's fencing
tokens). So every work Pod carries the token of the leadership it was created under, the leader
writes its token into the release's WorkFence before its first item, and an admission policy (the
chart's ValidatingAdmissionPolicy, whose param is that WorkFence) refuses a work Pod whose token is
not the fence's now:

    gpu-agent.io/leader             the Lease's holderIdentity when the agent began to lead
    gpu-agent.io/lease-uid          the Lease object's uid (a Lease deleted and recreated is new)
    gpu-agent.io/lease-transitions  its leaseTransitions (every change of holder counts one)

(holder, uid, transitions) names one leadership: the same holder leading again after someone
else did has a higher transitions count, and after a release (the record deleted) a new uid.
"""

from __future__ import annotations

from dataclasses import dataclass

LEADER = "gpu-agent.io/leader"
LEASE_UID = "gpu-agent.io/lease-uid"
LEASE_TRANSITIONS = "gpu-agent.io/lease-transitions"


@dataclass(frozen=True)
class LeaderToken:
    holder: str
    lease_uid: str
    transitions: int

    def annotations(self) -> dict[str, str]:
        return {LEADER: self.holder, LEASE_UID: self.lease_uid, LEASE_TRANSITIONS: str(self.transitions)}

    def admits(self, annotations: dict[str, str] | None) -> bool:
        """What the admission policy checks: a Pod's annotations name this leadership."""
        annotations = annotations or {}
        return annotations.get(LEADER) == self.holder and annotations.get(LEASE_UID) == self.lease_uid \
            and annotations.get(LEASE_TRANSITIONS) == str(self.transitions)

    def __str__(self) -> str:
        return f"{self.holder} (lease {self.lease_uid[:8]}, transition {self.transitions})"
