"""`fake-gpu fault`: locally on the state file, on a cluster through the layout ConfigMap (against a stand-in API),
and what the DaemonSet makes of a layout's faults (state file and device list)."""

import json
from types import SimpleNamespace

import pytest
from kubernetes import client

from fake_gpu.cli import main as fake_gpu
from fake_gpu.cluster import ClusterLayout
from fake_gpu.daemon import LayoutApplier
from fake_gpu.layout import Fault, LayoutError, classify
from fake_gpu.layout_source import layout_for
from fake_gpu.plugin import Devices
from gpu_agent.foundations import fake_state


def healths(path):
    return [(g.health, g.health_reason) for g in fake_state.read(path).gpus]


@pytest.fixture
def state(tmp_path):
    path = tmp_path / "gpus.json"
    assert fake_gpu(["--state-file", str(path), "set", "--count", "4"]) == 0
    return path


@pytest.mark.parametrize("args,expected", [
    (["--xid", "79"], ("Lost", "Xid 79 (GPU has fallen off the bus)")),
    (["--xid", "48"], ("Unhealthy", "Xid 48 (double-bit ECC error)")),
    (["--xid", "150"], ("Unhealthy", "Xid 150")),
    (["--ecc", "double"], ("Unhealthy", "double-bit ECC error (uncorrectable)")),
    (["--lost"], ("Lost", "GPU is lost (NVML_ERROR_GPU_IS_LOST: not answering, e.g. fallen off the bus)")),
])
def test_a_fault_breaks_the_one_gpu_as_the_agents_tables_say(state, capsys, args, expected):
    assert fake_gpu(["--state-file", str(state), "fault", "--gpu", "2", *args]) == 0
    assert healths(state) == [("Healthy", "")] * 2 + [expected] + [("Healthy", "")]
    assert f"GPU 2 is now {expected[0]}: {expected[1]}" in capsys.readouterr().out


@pytest.mark.parametrize("args,why", [
    (["--xid", "13"], "Xid 13 (graphics engine exception) is an application error, ignored"),
    (["--xid", "109"], "Xid 109 (context switch timeout) is an application error, ignored"),
    (["--ecc", "single"], "a single-bit ECC error is corrected by the hardware: counted, not acted on"),
])
def test_an_application_xid_or_a_single_bit_ecc_error_changes_nothing_and_writes_nothing(state, capsys, args, why):
    before = state.read_text()
    assert fake_gpu(["--state-file", str(state), "fault", "--gpu", "0", *args]) == 0
    assert state.read_text() == before
    assert f"GPU 0 unchanged: {why}" in capsys.readouterr().out


def test_clear_heals_one_gpu_or_all(state, capsys):
    for gpu, xid in (("0", "48"), ("1", "79"), ("3", "94")):
        assert fake_gpu(["--state-file", str(state), "fault", "--gpu", gpu, "--xid", xid]) == 0
    assert fake_gpu(["--state-file", str(state), "fault", "--clear", "--gpu", "1"]) == 0
    assert [h for h, _ in healths(state)] == ["Unhealthy", "Healthy", "Healthy", "Unhealthy"]
    assert fake_gpu(["--state-file", str(state), "fault", "--clear"]) == 0
    assert [h for h, _ in healths(state)] == ["Healthy"] * 4
    assert "every fault cleared" in capsys.readouterr().out


def test_set_keeps_the_faults_of_the_gpus_that_stay_and_status_shows_them(state, capsys):
    uuids = [g.uuid for g in fake_state.read(state).gpus]
    assert fake_gpu(["--state-file", str(state), "fault", "--gpu", "1", "--xid", "48"]) == 0
    assert fake_gpu(["--state-file", str(state), "fault", "--gpu", "3", "--lost"]) == 0
    assert fake_gpu(["--state-file", str(state), "set", "--count", "2"]) == 0
    assert [g.uuid for g in fake_state.read(state).gpus] == uuids[:2]
    assert [h for h, _ in healths(state)] == ["Healthy", "Unhealthy"]
    capsys.readouterr()
    assert fake_gpu(["--state-file", str(state), "status"]) == 0
    gpus = json.loads(capsys.readouterr().out)["gpus"]
    assert gpus[1]["health"] == "Unhealthy" and gpus[1]["healthReason"] == "Xid 48 (double-bit ECC error)"
    assert "health" not in gpus[0]


@pytest.mark.parametrize("args,words", [
    (["--gpu", "4", "--xid", "48"], "--gpu must be between 0 and 3"),
    (["--gpu", "-1", "--lost"], "--gpu must be between 0 and 3"),
    (["--xid", "48"], "--gpu INDEX is required"),
    (["--gpu", "0", "--xid", "0"], "--xid must be an Xid number between 1 and 9999"),
    (["--gpu", "0", "--xid", "10000"], "--xid must be an Xid number between 1 and 9999"),
])
def test_bad_faults_are_refused_naming_the_flag_and_change_nothing(state, capsys, args, words):
    before = state.read_text()
    assert fake_gpu(["--state-file", str(state), "fault", *args]) == 2
    assert words in capsys.readouterr().err and state.read_text() == before


def test_a_fault_needs_an_existing_state_file(tmp_path, capsys):
    assert fake_gpu(["--state-file", str(tmp_path / "none.json"), "fault", "--gpu", "0", "--lost"]) == 2
    assert "fake-gpu set --count N" in capsys.readouterr().err


def test_one_kind_of_fault_at_a_time():
    with pytest.raises(SystemExit) as e:
        fake_gpu(["fault", "--gpu", "0", "--xid", "48", "--lost"])
    assert e.value.code == 2


# -- the layout ConfigMap's faults ------------------------------------------------------------------------------

def test_a_layout_entry_carries_faults_by_index_and_round_trips():
    entry = ('{"count": 4, "faults": {"2": {"health": "Lost", "healthReason": "Xid 79 (GPU has fallen off the bus)"},'
             ' "0": {"health": "Unhealthy"}}}')
    layout = layout_for({"n1": entry}, "n1", 0)
    assert layout.fault_map == {0: Fault("Unhealthy", "fault injected by fake-gpu"),
                                2: Fault("Lost", "Xid 79 (GPU has fallen off the bus)")}
    assert layout_for({"n1": layout.to_json()}, "n1", 0) == layout
    assert "faults" not in layout_for({"n1": '{"count": 2}'}, "n1", 0).to_json()


@pytest.mark.parametrize("faults,words", [
    ('[]', "faults must be an object"),
    ('{"x": {"health": "Lost"}}', "faults key 'x' must be a GPU index"),
    ('{"4": {"health": "Lost"}}', "faults: GPU 4 is not among the node's 4 GPUs"),
    ('{"1": {"health": "Healthy"}}', "faults.1.health must be one of Unhealthy, Lost"),
    ('{"1": {"health": "Lost", "colour": "red"}}', "faults.1 must be an object with health and healthReason"),
    ('{"1": {"health": "Lost", "healthReason": ""}}', "faults.1.healthReason must be a non-empty printable string"),
    ('{"1": "Lost"}', "faults.1 must be an object"),
])
def test_bad_faults_in_a_layout_are_refused_naming_the_field(faults, words):
    with pytest.raises(LayoutError) as e:
        layout_for({"n1": f'{{"count": 4, "faults": {faults}}}'}, "n1", 0)
    assert words in str(e.value)


def test_the_xid_classes():
    assert classify(xid=79)[0] == Fault("Lost", "Xid 79 (GPU has fallen off the bus)")
    assert classify(xid=48)[0].health == "Unhealthy"
    assert classify(xid=13)[0] is None and classify(ecc="single")[0] is None
    assert classify(lost=True)[0].health == "Lost"


class CoreV1:
    """The few CoreV1Api calls ClusterLayout makes, on one ConfigMap and a list of nodes."""

    def __init__(self, data, nodes=("n1", "n2")):
        self.cm = client.V1ConfigMap(metadata=client.V1ObjectMeta(name="fg-layout", resource_version="7"), data=data)
        self.nodes = nodes
        self.patches = []

    def list_namespaced_config_map(self, namespace, label_selector, _request_timeout):
        return SimpleNamespace(items=[self.cm])

    def read_node(self, name, _request_timeout):
        if name not in self.nodes:
            raise client.ApiException(status=404)

    def list_node(self, _request_timeout):
        return SimpleNamespace(items=[client.V1Node(metadata=client.V1ObjectMeta(name=n)) for n in self.nodes])

    def patch_namespaced_config_map(self, name, namespace, patch, _request_timeout):
        self.patches.append(patch)
        self.cm.data = {**self.cm.data, **patch["data"]}


def cluster(data):
    layout = ClusterLayout.__new__(ClusterLayout)  # no kubeconfig: the API is the stand-in
    layout.core, layout.namespace, layout.release = CoreV1(data), "gpu-agent", None
    return layout


def test_fault_on_a_node_goes_into_its_layout_entry_as_a_compare_and_swap():
    c = cluster({"n1": '{"count": 4}', "maxCount": "8"})
    c.fault("n1", 1, Fault("Lost", "Xid 79 (GPU has fallen off the bus)"))
    (patch,) = c.core.patches
    assert patch["metadata"]["resourceVersion"] == "7"
    assert json.loads(patch["data"]["n1"])["faults"] == {"1": {"health": "Lost",
                                                                "healthReason": "Xid 79 (GPU has fallen off the bus)"}}
    c.fault("n1", 3, Fault("Unhealthy", "Xid 48 (double-bit ECC error)"))
    c.fault("n1", 1, None)  # clear one
    assert list(json.loads(c.core.cm.data["n1"])["faults"]) == ["3"]
    c.fault("n1", None, None)  # clear all
    assert "faults" not in json.loads(c.core.cm.data["n1"])


def test_set_on_a_node_keeps_the_faults_of_the_gpus_that_stay():
    c = cluster({"n1": '{"count": 4, "clique": "rack-a", "faults": {"1": {"health": "Lost", "healthReason": "x"}, '
                       '"3": {"health": "Unhealthy", "healthReason": "y"}}}', "maxCount": "8"})
    c.set("n1", 2, "NVIDIA H100 80GB HBM3", 81559)
    doc = json.loads(c.core.cm.data["n1"])
    assert doc["count"] == 2 and doc["clique"] == "rack-a" and list(doc["faults"]) == ["1"]


@pytest.mark.parametrize("node,gpu,words", [
    ("n2", 0, "node n2 has no layout in the fake-gpu ConfigMap yet"),
    ("n9", 0, "unknown node 'n9'"),
    ("n1", 4, "--gpu must be between 0 and 3 (node n1 has 4 fake GPUs)"),
])
def test_a_refused_fault_on_a_node_writes_nothing(node, gpu, words):
    c = cluster({"n1": '{"count": 4}'})
    with pytest.raises(LayoutError) as e:
        c.fault(node, gpu, Fault("Lost", "x"))
    assert words in str(e.value) and c.core.patches == []


def test_an_ignored_xid_on_a_node_checks_the_gpu_and_writes_nothing():
    c = cluster({"n1": '{"count": 4}'})
    c.fault("n1", 2, None, write=False)
    assert c.core.patches == []
    with pytest.raises(LayoutError):
        c.fault("n1", 7, None, write=False)


def test_the_daemon_writes_a_layouts_faults_to_the_state_file_and_the_device_list(tmp_path):
    path = tmp_path / "state.json"
    devices = Devices()
    applier = LayoutApplier("n1", path, devices, default_count=0)
    applier.apply({"n1": '{"count": 3}'})
    uuids = [g.uuid for g in fake_state.read(path).gpus]
    version = devices.version
    applier.apply({"n1": '{"count": 3, "faults": {"1": {"health": "Lost", "healthReason": "Xid 79"}}}'})
    assert [g.uuid for g in fake_state.read(path).gpus] == uuids  # the same GPUs, one of them lost
    assert healths(path)[1] == ("Lost", "Xid 79")
    assert devices.version == version + 1 and [g.is_healthy for g in devices.get().gpus] == [True, False, True]
    applier.apply({"n1": '{"count": 3}'})
    assert [h for h, _ in healths(path)] == ["Healthy"] * 3 and devices.version == version + 2
    applier.apply({"n1": '{"count": 3}'})
    assert devices.version == version + 2  # nothing changed, nothing re-sent


class Racing(CoreV1):
    """Another writer changes n2's entry between this writer's read and its write, `races` times: the API server
    answers the stale resourceVersion with 409 Conflict."""

    def __init__(self, data, races):
        super().__init__(data)
        self.races = races

    def patch_namespaced_config_map(self, name, namespace, patch, _request_timeout):
        if patch["metadata"]["resourceVersion"] != self.cm.metadata.resource_version:
            raise client.ApiException(status=409, reason="Conflict")
        if self.races:
            self.races -= 1
            self.cm.data = {**self.cm.data, "n2": json.dumps({"count": 10 - self.races})}
            self.cm.metadata.resource_version = str(int(self.cm.metadata.resource_version) + 1)
            raise client.ApiException(status=409, reason="Conflict")
        super().patch_namespaced_config_map(name, namespace, patch, _request_timeout)


def test_a_set_or_fault_that_loses_a_race_reads_again_and_keeps_the_other_writers_entry():
    c = cluster({"n1": '{"count": 4}', "maxCount": "16"})
    c.core = Racing(c.core.cm.data, races=3)
    c.set("n1", 2, "NVIDIA H100 80GB HBM3", 81559)
    assert json.loads(c.core.cm.data["n1"])["count"] == 2 and json.loads(c.core.cm.data["n2"])["count"] == 10
    c.core.races = 2
    c.fault("n1", 1, Fault("Lost", "Xid 79 (GPU has fallen off the bus)"))
    assert list(json.loads(c.core.cm.data["n1"])["faults"]) == ["1"] and json.loads(c.core.cm.data["n2"])["count"] == 10
    c.core.races = 99  # a writer that always wins: the conflict reaches the caller after a bounded number of tries
    with pytest.raises(client.ApiException) as e:
        c.set("n1", 3, "NVIDIA H100 80GB HBM3", 81559)
    assert e.value.status == 409
