"""A node's NVLink clique, from what NVML says about each GPU's fabric.

On multi-node NVLink systems (GB200 NVL72 and the like) the GPUs that share one NVLink fabric
partition form a clique; a node can only be a peer of nodes in its own clique. NVML reports,
per GPU (`nvmlDeviceGetGpuFabricInfo`): the fabric state (not supported, not started, in
progress, completed), the fabric's cluster UUID and the clique ID. The node's clique is
`<clusterUuid>.<cliqueId>` when every GPU's registration with the fabric manager has completed
and they all agree; otherwise it has none, and the reason says why (a plain server's GPUs say
"not supported", which is no fault).
"""

from __future__ import annotations

import uuid as uuidlib
from dataclasses import dataclass

NOT_SUPPORTED, NOT_STARTED, IN_PROGRESS, COMPLETED = 0, 1, 2, 3
STATE_NAMES = {NOT_SUPPORTED: "not supported", NOT_STARTED: "not started", IN_PROGRESS: "in progress",
               COMPLETED: "completed"}


@dataclass(frozen=True)
class GPUFabric:
    """One GPU's fabric as NVML reports it; `status` is the NVML return code of the registration (0: success)."""
    state: int
    status: int = 0
    cluster_uuid: bytes = b""
    clique_id: int = 0

    @property
    def clique(self) -> str:
        cluster = uuidlib.UUID(bytes=bytes(self.cluster_uuid[:16]).ljust(16, bytes(1)))
        return f"{cluster}.{self.clique_id}"


@dataclass(frozen=True)
class NodeFabric:
    clique: str  # "" when the node has none
    reason: str  # what the fabric says, for /healthz


def node_fabric(gpus: list[GPUFabric]) -> NodeFabric:
    if not gpus:
        return NodeFabric("", "no GPUs")
    states = {g.state for g in gpus}
    if states == {NOT_SUPPORTED}:
        return NodeFabric("", "fabric not supported (no multi-node NVLink)")
    pending = [i for i, g in enumerate(gpus) if g.state != COMPLETED]
    if pending:
        names = sorted({STATE_NAMES.get(gpus[i].state, f"state {gpus[i].state}") for i in pending})
        return NodeFabric("", f"fabric registration {', '.join(names)} on GPU(s) {', '.join(map(str, pending))}")
    failed = [i for i, g in enumerate(gpus) if g.status != 0]
    if failed:
        return NodeFabric("", f"fabric registration failed on GPU(s) {', '.join(map(str, failed))} "
                              f"(NVML status {gpus[failed[0]].status})")
    cliques = sorted({g.clique for g in gpus})
    if len(cliques) > 1:
        return NodeFabric("", f"GPUs disagree on their clique ({', '.join(cliques)})")
    return NodeFabric(cliques[0], f"fabric completed: clique {cliques[0]}")
