"""`fake-gpu daemon` on one node, its layout watch stood in for: the state file follows the layout either way, and
kubelet's device plugin runs only unless `--no-device-plugin` (a node whose GPUs the node agent offers through DRA
must not advertise them as nvidia.com/gpu as well)."""

import queue
import threading
import time

import pytest
from fake_kubelet import Kubelet

from fake_gpu.daemon import Daemon
from fake_gpu.plugin import SOCKET_NAME
from gpu_agent.foundations import fake_state


def wait_for(pred, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.parametrize("device_plugin", [True, False], ids=["device plugin on", "device plugin off"])
def test_without_its_device_plugin_the_daemon_follows_the_layout_but_never_serves_kubelet(tmp_path, device_plugin):
    plugin_dir = tmp_path / "device-plugins"
    plugin_dir.mkdir()
    kubelet = Kubelet(plugin_dir)
    state = tmp_path / "fake-gpus.json"
    layouts: queue.Queue = queue.Queue()
    layouts.put({"n1": '{"count": 2}'})

    def watch(applier, stopping):  # the layout ConfigMap's watch: each layout the test puts, as it comes
        while not stopping.is_set():
            try:
                applier.apply(layouts.get(timeout=0.05))
            except queue.Empty:
                pass

    daemon = Daemon("n1", state, "/host/fake-gpus.json", plugin_dir, 0, watch=watch, device_plugin=device_plugin)
    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: state.exists() and fake_state.read(state).count == 2)
        layouts.put({"n1": '{"count": 3}'})  # still watched
        wait_for(lambda: fake_state.read(state).count == 3)
        if device_plugin:  # the same daemon with its plugin: serves kubelet at once (what the other case must not do)
            wait_for(lambda: kubelet.requests)
            assert kubelet.requests[0].resource_name == "nvidia.com/gpu" and (plugin_dir / SOCKET_NAME).is_socket()
        else:
            time.sleep(1.0)  # the plugin's first round would have registered at once; give it a second, twice over
            assert kubelet.requests == []
            assert sorted(p.name for p in plugin_dir.iterdir()) == ["kubelet.sock"]  # no socket of ours, ever
    finally:
        daemon.stop()
        thread.join(5)
        kubelet.server.stop(grace=0)
    assert not thread.is_alive()  # stop ends run either way


@pytest.mark.parametrize("flag,expected", [([], True), (["--no-device-plugin"], False), (["--device-plugin"], True)])
def test_the_daemon_command_passes_whether_to_run_the_device_plugin(monkeypatch, flag, expected):
    import fake_gpu.daemon
    from fake_gpu import cli

    seen = {}
    monkeypatch.setattr(fake_gpu.daemon, "run", lambda *args, **kwargs: seen.update(kwargs) or 0)
    assert cli.main(["daemon", "--node-name", "n1", *flag]) == 0
    assert seen["device_plugin"] is expected
