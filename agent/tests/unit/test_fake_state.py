import json
import random

import pytest

from fake_gpu.cli import main as fake_gpu
from fake_gpu.layout import LayoutError, build
from gpu_agent.foundations import fake_state
from gpu_agent.foundations.gpus import Inventory
from gpu_agent.mechanisms.inventory.fake import FakeFileSource


def test_round_trip_through_the_agent_source(tmp_path):
    path = tmp_path / "gpus.json"
    inv = build(Inventory(), 3, "NVIDIA H100 80GB HBM3", 81559, random.Random(1))
    fake_state.write_atomic(path, fake_state.render(inv, "node-a"))
    reading = FakeFileSource(path).read()
    assert reading.error is None and reading.inventory == inv
    assert all(g.uuid.startswith("GPU-") for g in reading.inventory.gpus)


def test_layout_keeps_the_uuids_of_gpus_that_stay():
    rng = random.Random(3)
    two = build(Inventory(), 2, "P", 1024, rng)
    four = build(two, 4, "P", 1024, rng)
    one = build(four, 1, "P", 1024, rng)
    assert four.gpus[:2] == two.gpus and one.gpus[0] == two.gpus[0]
    assert len(four.uuids) == 4


@pytest.mark.parametrize("count,max_gpus", [(-1, 64), (65, 64), (9, 8)])
def test_bad_counts_are_refused(count, max_gpus):
    with pytest.raises(LayoutError, match="--count"):
        build(Inventory(), count, "P", 1024, random.Random(), max_gpus)


@pytest.mark.parametrize("text,fragment", [
    ("{not json", "not valid JSON"),
    ("[]", "top level must be an object"),
    ('{"apiVersion": "v0", "gpus": []}', "apiVersion must be"),
    (json.dumps({"apiVersion": fake_state.API_VERSION, "gpus": {}}), "'gpus' must be a list"),
    (json.dumps({"apiVersion": fake_state.API_VERSION, "gpus": [{"uuid": "nope"}]}), "gpus[0].uuid"),
    (json.dumps({"apiVersion": fake_state.API_VERSION, "gpus": [
        {"uuid": "GPU-00000000-0000-0000-0000-000000000000", "name": "x", "memoryTotalBytes": -5}]}), "gpus[0].memoryTotalBytes"),
])
def test_malformed_files_give_an_error_naming_the_field(tmp_path, text, fragment):
    path = tmp_path / "gpus.json"
    path.write_text(text)
    reading = FakeFileSource(path).read()
    assert reading.inventory.count == 0
    assert fragment in reading.error


def test_missing_file_says_how_to_create_it(tmp_path):
    reading = FakeFileSource(tmp_path / "nope.json").read()
    assert "does not exist" in reading.error and "fake-gpu set --count" in reading.error


def test_command_refuses_bad_input_and_changes_nothing(tmp_path, capsys):
    path = tmp_path / "gpus.json"
    assert fake_gpu(["--state-file", str(path), "set", "--count", "2"]) == 0
    before = path.read_text()
    assert fake_gpu(["--state-file", str(path), "set", "--count", "-3"]) == 2
    assert fake_gpu(["--state-file", str(path), "set", "--count", "100"]) == 2
    assert "--count must be" in capsys.readouterr().err
    assert path.read_text() == before
    assert fake_gpu(["--state-file", str(path), "status"]) == 0
    assert '"count": 2' in capsys.readouterr().out


def test_atomic_write_leaves_no_temporary_files(tmp_path):
    path = tmp_path / "gpus.json"
    for n in range(5):
        fake_state.write_atomic(path, fake_state.render(Inventory(), str(n)))
    assert [p.name for p in tmp_path.iterdir()] == ["gpus.json"]


def test_fake_gpu_set_clique_reaches_the_agent_source_and_is_kept_until_changed(tmp_path, capsys):
    path = tmp_path / "s.json"
    assert fake_gpu(["--state-file", str(path), "set", "--count", "2", "--clique", "rack-a"]) == 0
    reading = FakeFileSource(path).read()
    assert (reading.inventory.count, reading.inventory.clique) == (2, "rack-a")
    assert fake_gpu(["--state-file", str(path), "set", "--count", "3"]) == 0  # no --clique: the clique stays
    assert fake_state.read(path).clique == "rack-a"
    assert fake_gpu(["--state-file", str(path), "set", "--count", "3", "--clique", ""]) == 0
    assert fake_state.read(path).clique == ""
    assert fake_gpu(["--state-file", str(path), "set", "--count", "3", "--clique", "bad clique!"]) == 2
    assert "--clique must be empty" in capsys.readouterr().err
    assert fake_state.read(path).count == 3, "a refused change loses nothing"


def test_a_state_file_with_a_bad_clique_names_the_field(tmp_path):
    doc = json.loads(fake_state.render(Inventory()))
    doc["clique"] = "x" * 65
    with pytest.raises(fake_state.FakeStateError) as e:
        fake_state.parse(json.dumps(doc))
    assert "field 'clique'" in str(e.value)
