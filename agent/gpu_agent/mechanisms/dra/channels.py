"""A GPUDomain's channel, as a DRA device: what preparing a channel claim asks of the domain, and what it injects.

    prepare(channel claim) ──> ChannelConfig {domain, allocationMode} (config.py)
        ──> gate.join(domain, claim)           this node becomes a member of the domain (the ComputeDomain way:
                                               the domain forms where its workloads land)
        ──> gate.wait_ready(domain, until)     this node's entry in the domain's folded status is Ready
        ──> channel_edits(...)                 CDI: the channel device node(s), the domain's environment, and a
                                               read-only mount of the domain's view folder (its peer list)
    unprepare / stale cleanup ──> gate.release(domain, claim)   the node leaves once no claim holds it

The gate is the node agent's domain membership (mechanisms/domain/membership.py), handed in by the node
agent role: mechanisms stay independent of one another, so this module says only what it needs (DomainGate).

Channels: NVIDIA's driver injects `/dev/nvidia-caps-imex-channels/channel<N>` (channel 0 for Single, every channel
of the range for All). On a fake node the host device behind each is a harmless char device (`/dev/null`); on a real
one it is the driver's own channel node. Workloads written for IMEX find the path they expect either way.
"""

from __future__ import annotations

from typing import Any, Protocol

from gpu_agent.foundations.domain_view import DomainNotReady, MemberView

CHANNEL_DIR = "/dev/nvidia-caps-imex-channels"
VIEW_MOUNT = "/etc/gpu-agent/domain"  # where the workload reads the domain's peer list
PEERS_FILE = "peers"
DEFAULT_CHANNEL_COUNT = 2048  # NVIDIA's maxImexChannelCount: `All` gives channel0 .. channel2047


__all__ = ["DomainGate", "DomainNotReady", "MemberView", "channel_edits", "channel_paths"]


class DomainGate(Protocol):
    namespace: str

    def join(self, domain: str, claim: str) -> None:
        """This node joins `domain` for `claim` (idempotent); it stays a member while any claim holds it."""

    def release(self, domain: str, claim: str) -> None:
        """`claim` no longer holds `domain`; the node leaves once no claim (nor its configuration) keeps it."""

    def wait_ready(self, domain: str, timeout: float) -> MemberView:
        """Blocks up to `timeout` seconds for this node's entry to be Ready in the domain's status; raises
        DomainNotReady with the reason otherwise."""


def channel_paths(mode: str, count: int) -> list[str]:
    return [f"{CHANNEL_DIR}/channel{n}" for n in (range(count) if mode == "All" else range(1))]


def channel_edits(view: MemberView, *, mode: str, count: int, host_device: str, claim: str) -> dict[str, Any]:
    """The CDI edits of a prepared channel device (cdi.write_spec's per-device form). `host_device`: a path with
    `{n}` for the channel number (a real node's channel nodes), or one device (a fake node's /dev/null)."""
    nodes = [{"path": path, "hostPath": host_device.format(n=n), "permissions": "rw"}
             for n, path in enumerate(channel_paths(mode, count))]
    env = [f"GPU_AGENT_DOMAIN={view.namespace}/{view.domain}", f"GPU_AGENT_DOMAIN_UID={view.uid}",
           f"GPU_AGENT_DOMAIN_CLIQUE={view.clique}", f"GPU_AGENT_DOMAIN_NODE_INDEX={view.index}",
           f"GPU_AGENT_DOMAIN_PEERS={VIEW_MOUNT}/{PEERS_FILE}", f"GPU_AGENT_CHANNEL_ALLOCATION_MODE={mode}",
           f"GPU_AGENT_CLAIM={claim}"]
    # the folder, not the file: the peer list is replaced atomically (a new inode) on every change, and a bind
    # mount of the file would keep showing the old one
    mounts = [{"hostPath": str(view.view_dir), "containerPath": VIEW_MOUNT, "options": ["ro", "nosuid", "nodev", "bind"]}]
    return {"deviceNodes": nodes, "env": env, "mounts": mounts}
