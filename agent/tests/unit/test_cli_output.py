"""`gpu-agent queue list` and `gpu-agent inventory` for scripts: `-o json|yaml|wide`, the JSON shape held by a JSON
Schema, the default output as it was, and no secret in any of them. The command runs as a process (`python -m
gpu_agent`), against the reference control plane served over real HTTP on loopback by this test."""

import json
import os
import subprocess
import sys
from importlib import resources

import jsonschema
import pytest
import yaml

from gpu_agent import cli
from gpu_agent.foundations import fake_state
from gpu_agent.foundations.control_plane_client import ControlPlaneClient
from gpu_agent.foundations.gpus import GPU, LOST, Inventory
from gpu_agent.foundations.secrets import Secret
from gpu_agent.roles.control_plane.server import ControlPlane, ControlPlaneServer, ServerSettings
from gpu_agent.roles.control_plane.store import Store

REG = Secret("registration-token-0123456789")
ADMIN_VALUE = "admin-token-for-the-cli-0123456789"
ADMIN = Secret(ADMIN_VALUE)
T0 = 1_000_000.0  # the control plane's clock: createdAt of every item
LONG_ERROR = f"pod failed to start (its log printed {ADMIN_VALUE}):" + " image pull back-off" * 8  # > 120 chars


def schema(name):
    return json.loads(resources.files("gpu_agent").joinpath(f"schemas/{name}.schema.json").read_text())


def validator(name):
    doc = schema(name)
    jsonschema.Draft202012Validator.check_schema(doc)
    return jsonschema.Draft202012Validator(doc)


class Clock:
    now = T0

    def __call__(self):
        return self.now


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory):
    """A control plane holding one item done, one with a failed attempt (its error carries the admin token) and one
    queued."""
    clock = Clock()
    server = ControlPlaneServer(ControlPlane(Store(tmp_path_factory.mktemp("cp") / "cp.sqlite", clock),
                                             ServerSettings(REG, ADMIN, 60.0, 30.0, 60.0)), "127.0.0.1", 0)
    server.start()
    client = ControlPlaneClient(server.url, timeout=5)
    cred = client.register(REG, "c1", 1, Inventory((GPU("GPU-1", "fake", 1 << 30),))).credential.token
    for key in ("done-1", "failing-2", "queued-3"):
        client.enqueue(ADMIN, key, {"kind": "demo"})
    clock.now += 2.5
    client.ack(cred, client.lease(cred, 30))
    client.release(cred, client.lease(cred, 30), LONG_ERROR)
    client.close()
    yield server
    server.stop()


def gpu_agent(*argv, cwd, env=None, timeout=60):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GPU_AGENT_")}
    return subprocess.run([sys.executable, "-m", "gpu_agent", *argv], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env={**environ, **(env or {})})


def queue_list(control_plane, tmp_path, *argv):
    r = gpu_agent("queue", "list", "--control-plane-url", control_plane.url, *argv, cwd=tmp_path,
                  env={"GPU_AGENT_ADMIN_TOKEN": ADMIN_VALUE})
    assert r.returncode == 0, r.stderr
    return r.stdout


EXPECTED_ITEMS = [
    {"id": 1, "idempotencyKey": "done-1", "state": "done", "deliveries": 1, "failedAttempts": 0,
     "createdAt": T0, "ackedAt": T0 + 2.5, "lastError": None},
    {"id": 2, "idempotencyKey": "failing-2", "state": "queued", "deliveries": 1, "failedAttempts": 1,
     "createdAt": T0, "ackedAt": None, "lastError": LONG_ERROR.replace(ADMIN_VALUE, "<redacted>")},
    {"id": 3, "idempotencyKey": "queued-3", "state": "queued", "deliveries": 0, "failedAttempts": 0,
     "createdAt": T0, "ackedAt": None, "lastError": None},
]


def test_queue_list_json_is_the_documented_shape_and_validates_against_its_schema(control_plane, tmp_path):
    doc = json.loads(queue_list(control_plane, tmp_path, "-o", "json"))
    validator("queue-list").validate(doc)
    assert doc == {"apiVersion": "gpu-agent/v1", "kind": "QueueList", "items": EXPECTED_ITEMS,
                   "counts": {"queued": 2, "leased": 0, "done": 1, "failed": 0}}
    assert list(doc) == ["apiVersion", "kind", "items", "counts"]  # key order is part of the shape too
    assert [list(i) for i in doc["items"]] == [list(EXPECTED_ITEMS[0])] * 3


def test_queue_list_yaml_is_the_same_document(control_plane, tmp_path):
    doc = yaml.safe_load(queue_list(control_plane, tmp_path, "--output", "yaml"))
    validator("queue-list").validate(doc)
    assert doc == json.loads(queue_list(control_plane, tmp_path, "-o", "json"))


def test_the_schema_refuses_a_document_missing_or_adding_a_field():
    """The schema holds the shape: an item or a count that loses a key, or gains one, is refused."""
    v = validator("queue-list")
    good = cli.queue_list_document([{"id": 1, "idempotencyKey": "k", "state": "queued", "deliveries": 0,
                                     "createdAt": T0}], {"queued": 1})
    v.validate(good)
    for key in good["items"][0]:
        bad = json.loads(json.dumps(good))
        del bad["items"][0][key]
        assert not v.is_valid(bad), key
    for where in (good, good["items"][0], good["counts"]):
        where["surprise"] = 1
        assert not v.is_valid(good)
        del where["surprise"]
    assert not v.is_valid({**good, "counts": {"queued": 1, "leased": 0, "done": 0}})
    assert not v.is_valid({**good, "kind": "ItemList"})


def test_queue_list_without_o_prints_the_table_it_always_printed(control_plane, tmp_path):
    error = LONG_ERROR.replace(ADMIN_VALUE, "<redacted>")
    assert queue_list(control_plane, tmp_path) == (
        "    ID  KEY                              STATE   DELIVERIES FAILED  LAST ERROR\n"
        "     1  done-1                           done             1      0  \n"
        f"     2  failing-2                        queued           1      1  {error[:120]}\n"
        "     3  queued-3                         queued           0      0  \n"
        "counts: queued 2, leased 0, done 1, failed 0\n")


def test_queue_list_wide_adds_when_each_item_was_created_and_acked_and_the_whole_error(control_plane, tmp_path):
    lines = queue_list(control_plane, tmp_path, "-o", "wide").splitlines()
    assert lines[0].split() == ["ID", "KEY", "STATE", "DELIVERIES", "FAILED", "CREATED", "ACKED", "LAST", "ERROR"]
    created, acked = "1970-01-12T13:46:40Z", "1970-01-12T13:46:42Z"  # T0 and T0 + 2.5 s, UTC
    assert lines[1].split() == ["1", "done-1", "done", "1", "0", created, acked]
    assert lines[2].split()[:7] == ["2", "failing-2", "queued", "1", "1", created, "-"]
    assert lines[2].endswith(LONG_ERROR.replace(ADMIN_VALUE, "<redacted>")) and len(LONG_ERROR) > 120
    assert lines[-1] == "counts: queued 2, leased 0, done 1, failed 0"


@pytest.mark.parametrize("output", [None, "json", "yaml", "wide"])
def test_no_output_carries_the_admin_token_even_when_the_control_plane_sends_it_back(control_plane, tmp_path, output):
    out = queue_list(control_plane, tmp_path, *(["-o", output] if output else []))
    assert ADMIN_VALUE not in out and "<redacted>" in out


def test_a_failed_call_says_why_on_stderr_without_the_token_and_prints_nothing_to_parse(control_plane, tmp_path):
    r = gpu_agent("queue", "list", "-o", "json", "--control-plane-url", control_plane.url, cwd=tmp_path,
                  env={"GPU_AGENT_ADMIN_TOKEN": "not-the-admin-token-0123456789"})
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("gpu-agent queue list: error: ") and "not-the-admin-token" not in r.stderr


# ---- gpu-agent inventory ---------------------------------------------------------------------------------------


@pytest.fixture
def gpus_file(tmp_path):
    path = tmp_path / "gpus.json"
    gpus = (GPU("GPU-00000000-0000-0000-0000-000000000000", "NVIDIA H100 80GB HBM3", 80 << 30, index=0),
            GPU("GPU-00000000-0000-0000-0000-000000000001", "NVIDIA H100 80GB HBM3", 80 << 30, index=1,
                health=LOST, health_reason="Xid 79 (GPU has fallen off the bus)"))
    fake_state.write_atomic(path, fake_state.render(Inventory(gpus), node="n"))
    return path


def inventory(tmp_path, *argv):
    return gpu_agent("inventory", *argv, cwd=tmp_path)


def test_inventory_prints_json_by_default_as_before_and_its_schema_holds_it(tmp_path, gpus_file):
    r = inventory(tmp_path, "--fake-gpu-state-file", str(gpus_file))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    validator("inventory").validate(doc)
    assert r.stdout == json.dumps(doc, indent=2) + "\n"  # the default is the indented JSON it always was
    assert r.stdout == inventory(tmp_path, "--fake-gpu-state-file", str(gpus_file), "-o", "json").stdout
    assert (doc["source"], doc["count"], doc["error"]) == ("fake", 2, None)
    lost = doc["gpus"][1]
    assert (lost["health"], lost["healthReason"]) == ("Lost", "Xid 79 (GPU has fallen off the bus)")
    yaml_out = inventory(tmp_path, "--fake-gpu-state-file", str(gpus_file), "-o", "yaml")
    assert yaml_out.returncode == 0 and yaml.safe_load(yaml_out.stdout) == doc


def test_inventory_wide_is_a_table_of_the_gpus(tmp_path, gpus_file):
    r = inventory(tmp_path, "--fake-gpu-state-file", str(gpus_file), "-o", "wide")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["INDEX", "UUID", "NAME", "MEMORY", "MIG", "HEALTH", "REASON"]
    assert lines[1].split() == ["0", "GPU-00000000-0000-0000-0000-000000000000", "NVIDIA", "H100", "80GB", "HBM3",
                                "81920MiB", "off", "Healthy"]
    assert lines[2].endswith("Lost      Xid 79 (GPU has fallen off the bus)")
    assert lines[3].startswith("source: fake, count: 2, ")


@pytest.mark.parametrize("output", [None, "json", "yaml", "wide"])
def test_an_inventory_the_source_cannot_read_exits_1_and_says_why_in_every_format(tmp_path, output):
    r = inventory(tmp_path, "--fake-gpu-state-file", str(tmp_path / "missing.json"), *(["-o", output] if output else []))
    assert r.returncode == 1, r.stderr
    if output == "wide":
        assert "count: 0, clique: -, fabric: -, error: fake GPU state file " in r.stdout
        assert "missing.json does not exist" in r.stdout
    else:
        doc = (yaml.safe_load if output == "yaml" else json.loads)(r.stdout)
        validator("inventory").validate(doc)
        assert doc["count"] == 0 and "missing.json does not exist" in doc["error"]
