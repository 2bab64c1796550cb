"""The device plugin against a stand-in kubelet, over real gRPC on unix sockets."""

import threading
import time
from concurrent import futures
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from fake_gpu.deviceplugin import api_pb2, api_pb2_grpc
from fake_gpu.layout import LayoutError
from fake_gpu.layout_source import layout_for
from fake_gpu.plugin import Devices, PluginRunner
from gpu_agent.foundations.gpus import GPU, Inventory


def inventory(n):
    return Inventory(tuple(GPU(f"GPU-0000000{i}-0000-0000-0000-000000000000", "fake", 1 << 30, index=i) for i in range(n)))


class Kubelet(api_pb2_grpc.RegistrationServicer):
    def __init__(self, folder: Path):
        self.folder = folder
        self.requests = []
        self.server = None

    def Register(self, request, context):  # noqa: N802 - kubelet's gRPC method name
        self.requests.append(request)
        return api_pb2.Empty()

    def start(self):
        sock = self.folder / "kubelet.sock"
        if sock.exists():
            sock.unlink()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        api_pb2_grpc.add_RegistrationServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{sock}")
        self.server.start()

    def restart(self):
        """What kubelet does on start: delete plugin sockets, recreate its own."""
        self.server.stop(grace=0)
        for p in self.folder.glob("*.sock"):
            p.unlink()
        self.start()


def wait_for(pred, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def plugin(tmp_path):
    kubelet = Kubelet(tmp_path)
    kubelet.start()
    devices = Devices()
    runner = PluginRunner(tmp_path, devices, "/host/state.json", watch_interval=0.05)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    wait_for(lambda: kubelet.requests)
    yield kubelet, devices, runner
    runner.stop()
    thread.join(5)
    kubelet.server.stop(grace=0)


def stub(runner):
    channel = grpc.insecure_channel(f"unix://{runner.socket}")
    return channel, api_pb2_grpc.DevicePluginStub(channel)


def test_registers_as_nvidia_gpu(plugin):
    kubelet, _, _ = plugin
    req = kubelet.requests[0]
    assert (req.version, req.endpoint, req.resource_name) == ("v1beta1", "fake-gpu.sock", "nvidia.com/gpu")


def test_list_and_watch_sends_each_new_layout_at_once(plugin):
    _, devices, runner = plugin
    channel, dp = stub(runner)
    stream = dp.ListAndWatch(api_pb2.Empty())
    first = next(stream)
    assert list(first.devices) == []
    devices.set(inventory(4))
    started = time.monotonic()
    second = next(stream)
    assert time.monotonic() - started < 1.0
    assert sorted(d.ID for d in second.devices) == sorted(inventory(4).uuids)
    assert {d.health for d in second.devices} == {"Healthy"}
    devices.set(inventory(1))
    assert [d.ID for d in next(stream).devices] == [inventory(1).gpus[0].uuid]
    stream.cancel()
    channel.close()


def test_allocate_gives_visible_devices_and_the_state_file(plugin):
    _, devices, runner = plugin
    devices.set(inventory(2))
    channel, dp = stub(runner)
    ids = [g.uuid for g in inventory(2).gpus]
    resp = dp.Allocate(api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids)]))
    c = resp.container_responses[0]
    assert c.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(sorted(ids))
    assert c.mounts[0].host_path == "/host/state.json" and c.mounts[0].read_only
    with pytest.raises(grpc.RpcError) as e:
        dp.Allocate(api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=["GPU-nope"])]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    channel.close()


def test_registers_again_after_a_kubelet_restart(plugin):
    kubelet, _, runner = plugin
    kubelet.restart()
    wait_for(lambda: len(kubelet.requests) == 2)
    wait_for(lambda: runner.registrations == 2)
    assert runner.socket.exists()


@pytest.mark.parametrize("entry,words", [
    ('{"count": -1}', "count must be 0 or more"),
    ('{"count": 99}', "at most maxCount=8"),
    ('{"count": "x"}', "count must be"),
    ('{"count": 1, "colour": "red"}', "unknown field(s) colour"),
    ("not json", "not valid JSON"),
    ('{"count": 1, "clique": "rack a"}', "clique must be empty"),
    ('{"count": 1, "clique": 7}', "clique must be empty"),
])
def test_bad_layout_entries_are_refused(entry, words):
    with pytest.raises(LayoutError) as e:
        layout_for({"n1": entry, "maxCount": "8"}, "n1", 0)
    assert words in str(e.value)


def test_a_node_without_an_entry_gets_the_default():
    assert layout_for({"other": '{"count": 3}'}, "n1", 2).count == 2
    assert layout_for({"n1": '{"count": 3}'}, "n1", 2).count == 3


def test_a_layout_with_a_clique_gives_the_node_that_clique():
    layout = layout_for({"n1": '{"count": 2, "clique": "rack-a"}'}, "n1", 0)
    assert (layout.count, layout.clique) == (2, "rack-a")
    assert '"clique": "rack-a"' in layout.to_json()
    assert "clique" not in layout_for({"n1": '{"count": 2}'}, "n1", 0).to_json()


def test_list_and_watch_sends_again_when_only_a_gpus_health_changes(plugin):
    _, devices, runner = plugin
    channel, dp = stub(runner)
    stream = dp.ListAndWatch(api_pb2.Empty(), timeout=10)  # a send that never comes fails the test, not hangs it
    assert list(next(stream).devices) == []  # the list when the stream opened
    healthy = inventory(3)
    devices.set(healthy)
    assert {d.health for d in next(stream).devices} == {"Healthy"}
    lost, unhealthy = replace(healthy.gpus[1], health="Lost"), replace(healthy.gpus[2], health="Unhealthy")
    devices.set(Inventory((healthy.gpus[0], lost, unhealthy)))
    started = time.monotonic()
    sent = {d.ID: d.health for d in next(stream).devices}
    assert time.monotonic() - started < 1.0
    assert sent == {healthy.gpus[0].uuid: "Healthy", lost.uuid: "Unhealthy", unhealthy.uuid: "Unhealthy"}
    devices.set(healthy)  # cleared: Healthy again, no restart
    assert {d.health for d in next(stream).devices} == {"Healthy"}
    stream.cancel()
    channel.close()
