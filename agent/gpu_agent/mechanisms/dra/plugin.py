"""The kubelet side of the DRA driver: one gRPC server on one unix socket in the kubelet's plugin
registry (`<registry>/<driver>-reg.sock`), serving

    pluginregistration.Registration   GetInfo (type DRAPlugin, our name, endpoint "" = this socket,
                                      the DRA services we serve), NotifyRegistrationStatus
    k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin and .v1beta1.DRAPlugin   NodePrepareResources, NodeUnprepareResources
    v1alpha1.DRAResourceHealth        NodeWatchResources: each device's health, the whole list on every change

Timing rules: GetInfo answers at once (the kubelet allows it 1 s). A prepare or unprepare call is
answered before the kubelet's own deadline (45 s): the work gets the call's remaining time less
`DEADLINE_MARGIN`, and every claim asked about gets an answer, an error if need be. An empty prepare
(a health probe) gets an empty answer. The socket is removed and made again at start (a stale one
from a killed pod would refuse connections), and removed first at stop, so the kubelet deregisters
the plugin before the server goes.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from gpu_agent.foundations.clock import Clock, SystemClock
from gpu_agent.foundations.klog import get_logger
from gpu_agent.mechanisms.dra.kubeletapi.drav1 import api_pb2 as v1
from gpu_agent.mechanisms.dra.kubeletapi.drav1 import api_pb2_grpc as v1_grpc
from gpu_agent.mechanisms.dra.kubeletapi.drav1beta1 import api_pb2 as v1beta1
from gpu_agent.mechanisms.dra.kubeletapi.drav1beta1 import api_pb2_grpc as v1beta1_grpc
from gpu_agent.mechanisms.dra.kubeletapi.health import api_pb2 as health_pb
from gpu_agent.mechanisms.dra.kubeletapi.health import api_pb2_grpc as health_grpc
from gpu_agent.mechanisms.dra.kubeletapi.registration import api_pb2 as reg
from gpu_agent.mechanisms.dra.kubeletapi.registration import api_pb2_grpc as reg_grpc
from gpu_agent.mechanisms.dra.prepare import ClaimPreparer, ClaimRef

log = get_logger(__name__)

PLUGIN_TYPE = "DRAPlugin"
# gRPC service names, not versions: kubelet 1.36 takes the first of these it knows
SERVICES = ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth"]
DEADLINE_MARGIN = 2.0  # seconds kept back from the kubelet's deadline to send the answer
DEFAULT_CALL_SECONDS = 45.0  # the kubelet's deadline, when a caller sends none
SOCKET_PATH_LIMIT = 107  # Linux's sun_path holds 108 bytes with the final NUL
HEALTH_TIMEOUT_SECONDS = 30  # the kubelet marks a device Unknown when it hears nothing of it this long

DeviceHealth = tuple[str, str, str, str]  # (pool, device, HEALTHY|UNHEALTHY, message)


def registration_socket(registry_dir: Path, driver: str) -> Path:
    return registry_dir / f"{driver}-reg.sock"


class _Registration(reg_grpc.RegistrationServicer):  # type: ignore[misc]  # generated, so untyped (Any)
    def __init__(self, plugin: KubeletPlugin) -> None:
        self.plugin = plugin

    def GetInfo(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802 - gRPC method name
        return reg.PluginInfo(type=PLUGIN_TYPE, name=self.plugin.driver, endpoint="", supported_versions=SERVICES)

    def NotifyRegistrationStatus(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        self.plugin.registered(request.plugin_registered, request.error)
        return reg.RegistrationStatusResponse()


class _DRA:
    """Both DRA versions: the same messages and field numbers (v1 adds `share_id`, which we do not set)."""

    def __init__(self, plugin: KubeletPlugin, pb: Any) -> None:
        self.plugin, self.pb = plugin, pb

    def _deadline(self, context: grpc.ServicerContext) -> float:
        remaining = context.time_remaining()
        seconds = DEFAULT_CALL_SECONDS if remaining is None else remaining
        return self.plugin.clock.monotonic() + max(0.0, seconds - DEADLINE_MARGIN)

    def NodePrepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        refs = [ClaimRef(c.namespace, c.uid, c.name) for c in request.claims]
        if not refs:
            return self.pb.NodePrepareResourcesResponse()  # a health probe
        outcomes = self.plugin.preparer.prepare(refs, self._deadline(context))
        response = self.pb.NodePrepareResourcesResponse()
        for ref in refs:
            outcome = outcomes[ref.uid]
            entry = response.claims[ref.uid]
            if outcome.error:
                entry.error = outcome.error
                continue
            for d in outcome.devices:
                entry.devices.add(request_names=d["request_names"], pool_name=d["pool_name"], device_name=d["device_name"],
                                  cdi_device_ids=d["cdi_device_ids"])
        return response

    def NodeUnprepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        refs = [ClaimRef(c.namespace, c.uid, c.name) for c in request.claims]
        errors = self.plugin.preparer.unprepare(refs, self._deadline(context)) if refs else {}
        response = self.pb.NodeUnprepareResourcesResponse()
        for ref in refs:
            response.claims[ref.uid].error = errors.get(ref.uid, "")
        return response


class _V1(_DRA, v1_grpc.DRAPluginServicer):  # type: ignore[misc]  # generated, so untyped (Any)
    pass


class _V1beta1(_DRA, v1beta1_grpc.DRAPluginServicer):  # type: ignore[misc]  # generated, so untyped (Any)
    pass


class _Health(health_grpc.DRAResourceHealthServicer):  # type: ignore[misc]  # generated, so untyped (Any)
    def __init__(self, plugin: KubeletPlugin) -> None:
        self.plugin = plugin

    def NodeWatchResources(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:  # noqa: N802
        seen = -1
        while context.is_active() and not self.plugin.stopping.is_set():
            version, devices = self.plugin.wait_health(seen, timeout=1.0)
            if version == seen:
                continue
            seen = version
            now = int(self.plugin.clock.wall())
            yield health_pb.NodeWatchResourcesResponse(devices=[
                health_pb.DeviceHealth(device=health_pb.DeviceIdentifier(pool_name=pool, device_name=name),
                                       health=getattr(health_pb.HealthStatus, state), last_updated_time=now,
                                       health_check_timeout_seconds=HEALTH_TIMEOUT_SECONDS, message=message[:1024])
                for pool, name, state, message in devices])


class KubeletPlugin:
    def __init__(self, preparer: ClaimPreparer, *, driver: str, registry_dir: Path, clock: Clock | None = None,
                 workers: int = 8, on_registered: Callable[[bool, str], None] | None = None) -> None:
        self.preparer = preparer
        self.driver = driver
        self.socket = registration_socket(registry_dir, driver)
        self.clock = clock or SystemClock()
        self.workers = workers  # above the prepares that may block at once (they queue on one lock) plus probes
        self.on_registered = on_registered or (lambda ok, error: None)
        self.stopping = threading.Event()
        self._server: grpc.Server | None = None
        self._health = threading.Condition()
        self._health_version = 0
        self._health_devices: list[DeviceHealth] = []

    def registered(self, ok: bool, error: str) -> None:
        if ok:
            log.info("registered with the kubelet as DRA driver %s (socket %s)", self.driver, self.socket)
        else:
            log.error("the kubelet refused DRA driver %s: %s", self.driver, error)
        self.on_registered(ok, error)

    def set_health(self, devices: list[DeviceHealth]) -> None:
        with self._health:
            if devices != self._health_devices:
                self._health_devices = list(devices)
                self._health_version += 1
                self._health.notify_all()

    def wait_health(self, seen: int, timeout: float) -> tuple[int, list[DeviceHealth]]:
        with self._health:
            if self._health_version == seen:
                self._health.wait(timeout)
            return self._health_version, list(self._health_devices)

    def start(self) -> None:
        if len(str(self.socket).encode()) > SOCKET_PATH_LIMIT:
            raise OSError(f"the DRA registration socket path {self.socket} is {len(str(self.socket).encode())} bytes, "
                          f"more than a unix socket takes ({SOCKET_PATH_LIMIT}): point draRegistryDir at a shorter folder")
        self.socket.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket)  # a killed pod's socket: nobody answers on it
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="dra-grpc"))
        reg_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        v1_grpc.add_DRAPluginServicer_to_server(_V1(self, v1), server)
        v1beta1_grpc.add_DRAPluginServicer_to_server(_V1beta1(self, v1beta1), server)
        health_grpc.add_DRAResourceHealthServicer_to_server(_Health(self), server)
        try:
            bound = server.add_insecure_port(f"unix://{self.socket}")
        except RuntimeError:
            bound = 0
        if bound == 0:
            raise OSError(f"cannot listen on {self.socket}: check that draRegistryDir is a folder this agent may write")
        server.start()
        self._server = server
        log.info("DRA driver %s listening on %s for the kubelet", self.driver, self.socket)

    def stop(self, grace: float = 2.0) -> None:
        self.stopping.set()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket)  # first: the kubelet deregisters us before the server goes
        with self._health:
            self._health.notify_all()
        if self._server is not None:
            self._server.stop(grace).wait(grace + 1)
            self._server = None
