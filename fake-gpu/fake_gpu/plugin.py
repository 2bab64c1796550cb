"""A kubelet device plugin advertising the node's fake GPUs as `nvidia.com/gpu` (or the resource name it is given).

One device per fake GPU, its UUID as the device ID. ListAndWatch streams the device list
and sends a new one the moment the layout changes: a GPU arriving or leaving, or a GPU's health
(a faulted GPU is `Unhealthy`, so kubelet takes it out of allocatable; `Healthy` again after a clear,
with no restart of anything). Allocate hands the container
`NVIDIA_VISIBLE_DEVICES` with the allocated UUIDs and mounts the node's state file read-only,
so `fake-gpu smi -L` inside it prints one `UUID: GPU-…` line per GPU it was given.

Kubelet deletes plugin sockets and recreates its own when it restarts; a watcher notices
(kubelet.sock's inode changed, or our socket vanished) and serves and registers again.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import Message

from fake_gpu.deviceplugin import api_pb2, api_pb2_grpc
from fake_gpu.real_gpu_guard import DEFAULT_RESOURCE
from gpu_agent.foundations.gpus import GPU, Inventory
from gpu_agent.foundations.klog import get_logger

log = get_logger("fake_gpu.plugin")

SOCKET_NAME = "fake-gpu.sock"
STATE_IN_CONTAINER = "/run/fake-gpu/state.json"
VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
# Linux's MAX_ARG_STRLEN (32 pages): execve refuses a longer "NAME=value" string, so a container whose
# NVIDIA_VISIBLE_DEVICES lists more than about 3,196 UUIDs (41 bytes each) would fail to start, after its pod
# was admitted; Allocate refuses it instead, by name.
MAX_ENV_STRING = 32 * 4096


def max_visible_devices(uuid_chars: int = 40) -> int:
    """How many GPU UUIDs of `uuid_chars` fit NVIDIA_VISIBLE_DEVICES (comma-separated) under MAX_ENV_STRING."""
    return (MAX_ENV_STRING - len(VISIBLE_DEVICES) - 2 + 1) // (uuid_chars + 1)


def _advertised(inventory: Inventory) -> tuple[tuple[str, bool], ...]:
    """What kubelet is told: each device and whether it is healthy."""
    return tuple((g.uuid, g.is_healthy) for g in inventory.gpus)


def device_health(gpu: GPU) -> str:
    """Kubelet knows two states; a Lost GPU is as unusable as an Unhealthy one."""
    return "Healthy" if gpu.is_healthy else "Unhealthy"


class Devices:
    """The current device list, with a condition ListAndWatch streams wait on."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inventory = Inventory()
        self.version = 0

    def set(self, inventory: Inventory) -> None:
        with self._cond:
            if _advertised(inventory) != _advertised(self._inventory):
                self._inventory = inventory
                self.version += 1
                self._cond.notify_all()

    def get(self) -> Inventory:
        with self._cond:
            return self._inventory

    def wait_newer(self, version: int, timeout: float) -> tuple[int, Inventory]:
        with self._cond:
            self._cond.wait_for(lambda: self.version != version, timeout)
            return self.version, self._inventory


class FakeGPUPlugin(api_pb2_grpc.DevicePluginServicer):  # type: ignore[misc]  # generated, so untyped (Any)
    def __init__(self, devices: Devices, host_state_file: str, stopping: threading.Event) -> None:
        self.devices = devices
        self.host_state_file = host_state_file
        self.stopping = stopping

    # The generated messages are Any to mypy (see pyproject.toml), so these return Any.
    def GetDevicePluginOptions(self, request: Message, context: grpc.ServicerContext) -> Any:  # noqa: N802 - gRPC method names
        return api_pb2.DevicePluginOptions()

    def ListAndWatch(self, request: Message, context: grpc.ServicerContext) -> Iterator[Message]:  # noqa: N802 - gRPC method name
        version, inventory = -1, None
        while not self.stopping.is_set() and context.is_active():
            new_version, inventory = self.devices.wait_newer(version, timeout=1.0)
            if new_version == version:
                continue
            version = new_version
            unhealthy = len(inventory.unhealthy)
            log.info("advertising %d fake GPUs to kubelet%s", inventory.count, f" ({unhealthy} Unhealthy)" if unhealthy else "")
            yield api_pb2.ListAndWatchResponse(devices=[api_pb2.Device(ID=g.uuid, health=device_health(g))
                                                        for g in inventory.gpus])

    def Allocate(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802 - gRPC method name
        known = self.devices.get().uuids
        responses = []
        for req in request.container_requests:
            unknown = [d for d in req.devices_ids if d not in known]
            if unknown:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown fake GPU(s): {', '.join(unknown)}")
            ids = ",".join(sorted(req.devices_ids))
            if len(VISIBLE_DEVICES) + 1 + len(ids) + 1 > MAX_ENV_STRING:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"a container given {len(req.devices_ids)} fake GPUs cannot start: their {VISIBLE_DEVICES} "
                              f"would be {len(ids)} bytes, over Linux's {MAX_ENV_STRING}-byte limit on one environment "
                              f"string (execve); ask for at most {max_visible_devices()} GPUs per container")
            log.info("allocating %s", ids)
            responses.append(api_pb2.ContainerAllocateResponse(
                envs={VISIBLE_DEVICES: ids, "FAKE_GPU_STATE_FILE": STATE_IN_CONTAINER},
                mounts=[api_pb2.Mount(container_path=STATE_IN_CONTAINER, host_path=self.host_state_file, read_only=True)]))
        return api_pb2.AllocateResponse(container_responses=responses)

    def GetPreferredAllocation(self, request: Message, context: grpc.ServicerContext) -> Any:  # noqa: N802 - gRPC method name
        return api_pb2.PreferredAllocationResponse()

    def PreStartContainer(self, request: Message, context: grpc.ServicerContext) -> Any:  # noqa: N802 - gRPC method name
        return api_pb2.PreStartContainerResponse()


class PluginRunner:
    """Serves the plugin on its socket, registers with kubelet, and does both again after a
    kubelet restart."""

    def __init__(self, plugin_dir: Path, devices: Devices, host_state_file: str, watch_interval: float = 0.5,
                 resource: str = DEFAULT_RESOURCE) -> None:
        self.plugin_dir = plugin_dir
        self.resource = resource
        self.devices = devices
        self.host_state_file = host_state_file
        self.watch_interval = watch_interval
        self.stopping = threading.Event()
        self._server: grpc.Server | None = None
        self.registrations = 0

    @property
    def socket(self) -> Path:
        return self.plugin_dir / SOCKET_NAME

    @property
    def kubelet_socket(self) -> Path:
        return self.plugin_dir / "kubelet.sock"

    def _serve(self) -> None:
        if self._server is not None:
            # waited for: the old server's shutdown unlinks its socket path, and done after the new one bound it, the
            # kubelet would find no socket (seen once in the unit stage: registered again, no socket)
            self._server.stop(grace=0).wait(5)
        if self.socket.exists():
            self.socket.unlink()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        api_pb2_grpc.add_DevicePluginServicer_to_server(FakeGPUPlugin(self.devices, self.host_state_file, self.stopping), server)
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._server = server

    def _register(self) -> None:
        with grpc.insecure_channel(f"unix://{self.kubelet_socket}") as channel:
            grpc.channel_ready_future(channel).result(timeout=5)
            api_pb2_grpc.RegistrationStub(channel).Register(api_pb2.RegisterRequest(
                version="v1beta1", endpoint=SOCKET_NAME, resource_name=self.resource,
                options=api_pb2.DevicePluginOptions()), timeout=5)
        self.registrations += 1
        log.info("registered %s with kubelet (registration %d)", self.resource, self.registrations)

    def run(self) -> None:
        kubelet_inode = None
        while not self.stopping.is_set():
            try:
                inode = os.stat(self.kubelet_socket).st_ino
            except FileNotFoundError:
                inode = None
            if inode is not None and (inode != kubelet_inode or not self.socket.exists()):
                try:
                    self._serve()
                    self._register()
                    kubelet_inode = inode
                except Exception as e:  # noqa: BLE001 - kubelet may be mid-restart; try again
                    log.warning("registering with kubelet failed: %s; retrying", e)
                    time.sleep(1)
                    continue
            self.stopping.wait(self.watch_interval)
        if self._server is not None:
            self._server.stop(grace=1)
        if self.socket.exists():
            self.socket.unlink()

    def stop(self) -> None:
        self.stopping.set()
