"""Before fake-gpu first advertises on a node: is this a real GPU node? Then it refuses (issue 48, part 3).

    read the Node -> owned by fake-gpu? (annotation) -> capacity already has the resource? -> real devices on the host?
        refuse: one log line, a Warning Event on the Node, a refusal file the readiness probe prints; stay idle
        proceed: claim the node (annotation), then register with kubelet and label as before

fake-gpu registers its resource (by default `nvidia.com/gpu`) with kubelet, and kubelet keeps one plugin per resource
name: the last to register wins, so a fake-gpu pod on a node with the real NVIDIA device plugin would displace real
GPUs with fake ones, and its GPU feature discovery labels would overwrite the real ones. Two signs of a real GPU node:

- the Node's capacity already holds the resource while fake-gpu never claimed the node. The claim is the annotation
  owner_annotation(resource) (its value the resource name), set before the first registration and taken off by the chart's
  post-delete hook (`fake-gpu unlabel-nodes`), so fake-gpu's own restart (capacity still there: its own) proceeds;
- NVIDIA devices visible on the host: /dev/nvidia0, or a GPU under /proc/driver/nvidia/gpus (the driver's procfs
  folder is host-wide, also inside a container).

A person who means it (a mixed test on a real GPU node, with another resourceName) overrides with
`--allow-real-gpu-nodes` (chart value allowRealGpuNodes). The refused pod stays alive and idle rather than exit:
a crash loop would say less, and the refusal holds until the node or the values change anyway.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_agent.foundations.clock import Clock, SystemClock
from gpu_agent.foundations.klog import get_logger

log = get_logger("fake_gpu.real_gpu_guard")

DEFAULT_RESOURCE = "nvidia.com/gpu"
OWNER_PREFIX = "fake-gpu.gpu-agent.io/advertises."


def owner_annotation(resource: str) -> str:
    """The annotation by which fake-gpu claims `resource` on a node, its value the resource name: one key per
    resource, so that two releases advertising different resources on one node (the e2e suite's own, a test's) never
    overwrite each other's claim. The key's name part holds 63 characters: a longer resource is named by its hash."""
    name = OWNER_PREFIX.split("/", 1)[1] + resource.replace("/", "_")
    if len(name) > 63:
        name = OWNER_PREFIX.split("/", 1)[1] + hashlib.sha256(resource.encode()).hexdigest()[:20]
    return f"{OWNER_PREFIX.split('/', 1)[0]}/{name}"
REFUSED_REASON = "FakeGpuRefused"
ADMITTED_FILE = "admitted"  # written beside the refusal file once the check passed
# Where a real NVIDIA GPU shows on a host: the first device node, or the driver's folder of GPUs (one entry each).
REAL_GPU_PATHS = (Path("/dev/nvidia0"), Path("/proc/driver/nvidia/gpus"))
OVERRIDE = "set the chart value allowRealGpuNodes=true (fake-gpu daemon --allow-real-gpu-nodes) to advertise anyway"
# Reading the Node or writing the claim may fail while the API server is away: tried again after these waits.
RETRY_SECONDS = (1.0, 2.0, 5.0, 10.0, 30.0)

# An extended resource name: a DNS-subdomain prefix outside kubernetes.io, '/', and a name that leaves room for the
# longest label suffix (".product", 8 characters) within a label name's 63.
_RESOURCE_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]{0,53}[A-Za-z0-9])?")


def check_resource_name(name: str) -> str | None:
    """Why `name` cannot be fake-gpu's resource name, or None when it can."""
    if not _RESOURCE_NAME.fullmatch(name):
        return (f"resource name {name!r} is not an extended resource name (DOMAIN/NAME, e.g. {DEFAULT_RESOURCE}; "
                "NAME at most 55 characters)")
    domain = name.split("/", 1)[0]
    if domain == "kubernetes.io" or domain.endswith(".kubernetes.io"):
        return f"resource name {name!r} is in the kubernetes.io domain, which extended resources may not use"
    return None


@dataclass(frozen=True)
class Refusal:
    node: str
    found: str  # what made this a real GPU node, in words

    @property
    def message(self) -> str:
        return f"fake-gpu refuses node {self.node}: it looks like a real GPU node ({self.found}); {OVERRIDE}"


def capacity_of(node: dict[str, Any], resource: str, field: str = "capacity") -> int:
    """The Node's capacity (or allocatable) of `resource` (0 when absent). Extended resources are whole numbers;
    anything else the API server might hold counts as present."""
    value = str(((node.get("status") or {}).get(field) or {}).get(resource, "0"))
    try:
        return int(value)
    except ValueError:
        return 1


def owned(node: dict[str, Any], resource: str) -> bool:
    return ((node.get("metadata") or {}).get("annotations") or {}).get(owner_annotation(resource)) == resource


def real_devices(paths: Iterable[Path]) -> list[str]:
    """The paths that show a real NVIDIA GPU: a device node that exists, a folder with entries."""
    seen = []
    for path in paths:
        try:
            if path.is_dir():
                if any(path.iterdir()):
                    seen.append(str(path))
            elif path.exists():
                seen.append(str(path))
        except OSError:
            continue  # unreadable: no evidence either way
    return seen


def decide(node_name: str, node: dict[str, Any], resource: str, real_gpu_paths: Iterable[Path], *,
           allow_real_gpu_nodes: bool) -> Refusal | None:
    """None: fake-gpu may advertise here. A Refusal says what it found."""
    found = []
    capacity, allocatable = capacity_of(node, resource), capacity_of(node, resource, "allocatable")
    # A plugin that stopped leaves its devices in capacity, all unhealthy (allocatable 0), for kubelet's 5 minutes'
    # grace: fake-gpu's own just uninstalled (claim taken off) must not refuse its reinstall. A live plugin's devices
    # are allocatable; a real node whose plugin is down is still found by its devices on the host.
    if capacity > 0 and allocatable > 0 and not owned(node, resource):
        found.append(f"its capacity already has {resource}: {capacity}, advertised by another device plugin "
                     f"(fake-gpu's own would carry the annotation {owner_annotation(resource)}={resource})")
    devices = real_devices(real_gpu_paths)
    if devices:
        found.append(f"NVIDIA devices on the host: {', '.join(devices)}")
    if not found:
        return None
    refusal = Refusal(node_name, "; ".join(found))
    if allow_real_gpu_nodes:
        log.warning("node %s looks like a real GPU node (%s); advertising anyway: allowRealGpuNodes is set",
                    node_name, refusal.found)
        return None
    return refusal


class RealGpuGuard:
    """The check as the daemon runs it, once, before anything is advertised. `read_node(name)` returns the Node as
    JSON; `claim(name, resource)` writes owner_annotation(resource); `warn(node, refusal)` posts the Warning Event; each is the
    API's (with its request timeout), or a fake in unit tests. `refusal_file`: where the refusal is written for the
    readiness probe to print (None: not written). `clock` paces the retries (tests hand in one that does not wait)."""

    def __init__(self, node: str, resource: str, *, read_node: Callable[[str], dict[str, Any]],
                 claim: Callable[[str, str], object], warn: Callable[[dict[str, Any], Refusal], object],
                 real_gpu_paths: Iterable[Path] = REAL_GPU_PATHS, allow_real_gpu_nodes: bool = False,
                 refusal_file: Path | None = None, clock: Clock | None = None) -> None:
        self.node, self.resource = node, resource
        self.read_node, self.claim, self.warn = read_node, claim, warn
        self.real_gpu_paths = tuple(real_gpu_paths)
        self.allow_real_gpu_nodes = allow_real_gpu_nodes
        self.refusal_file = refusal_file
        self.clock = clock or SystemClock()
        self.refusal: Refusal | None = None

    def _retried(self, what: str, call: Callable[[], Any], stopping: threading.Event) -> tuple[bool, Any]:
        """(True, the call's result), or (False, None) once `stopping` is set while waiting to try again."""
        failures = 0
        while not stopping.is_set():
            try:
                return True, call()
            except Exception as e:  # noqa: BLE001 - the API server may be away; the reason is logged and it is retried
                wait = RETRY_SECONDS[min(failures, len(RETRY_SECONDS) - 1)]
                failures += 1
                log.warning("%s for node %s failed (%s); retrying in %.0f s", what, self.node,
                            getattr(e, "reason", None) or e, wait)
                self.clock.wait_blocking(stopping, wait)
        return False, None

    def admit(self, stopping: threading.Event) -> bool:
        """True: the node is claimed and fake-gpu may advertise. False: refused (or stopped before it knew)."""
        read, node = self._retried("reading the Node", lambda: self.read_node(self.node), stopping)
        if not read:
            return False
        refusal = decide(self.node, node, self.resource, self.real_gpu_paths,
                         allow_real_gpu_nodes=self.allow_real_gpu_nodes)
        if refusal is not None:
            self.refuse(node, refusal)
            return False
        if not owned(node, self.resource):
            # Claimed before the first registration: a restart after it finds the claim and its own capacity.
            claimed, _ = self._retried(f"annotating {owner_annotation(self.resource)}",
                                       lambda: self.claim(self.node, self.resource), stopping)
            if not claimed:
                return False
        self._admitted()
        return True

    def _admitted(self) -> None:
        """Beside the refusal file, a file saying the check passed: the readiness probe waits for one or the other,
        so that a pod is never Ready before it knows (a state file a former pod left on the host would say so)."""
        if self.refusal_file is None:
            return
        try:
            (self.refusal_file.parent / ADMITTED_FILE).write_text(f"fake-gpu may advertise on node {self.node}\n")
        except OSError as e:
            log.warning("cannot write %s: %s", self.refusal_file.parent / ADMITTED_FILE, e.strerror or e)

    def refuse(self, node: dict[str, Any], refusal: Refusal) -> None:
        self.refusal = refusal
        log.error("%s", refusal.message)
        if self.refusal_file is not None:
            try:
                self.refusal_file.write_text(refusal.message + "\n")
            except OSError as e:
                log.warning("cannot write the refusal file %s: %s", self.refusal_file, e.strerror or e)
        try:
            self.warn(node, refusal)
        except Exception as e:  # noqa: BLE001 - the Event is best effort; the log line and readiness already say it
            log.warning("posting the %s Event on node %s failed: %s", REFUSED_REASON, self.node,
                        getattr(e, "reason", None) or e)
