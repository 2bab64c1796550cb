import json
import random
from dataclasses import replace

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


def gpu_doc(**extra):
    return {"uuid": "GPU-00000000-0000-0000-0000-000000000000", "name": "x", "memoryTotalBytes": 1, **extra}


@pytest.mark.parametrize("extra,fragment", [
    ({"health": "Broken"}, "gpus[0].health must be one of Healthy, Unhealthy, Lost, got 'Broken'"),
    ({"health": 3}, "gpus[0].health must be one of"),
    ({"health": "Unhealthy", "healthReason": 48}, "gpus[0].healthReason must be a printable string"),
    ({"health": "Unhealthy", "healthReason": "a\nb"}, "gpus[0].healthReason must be a printable string"),
    ({"health": "Unhealthy", "healthReason": "x" * 257}, "of at most 256 characters"),
])
def test_a_bad_health_names_the_field_and_the_fix(extra, fragment):
    with pytest.raises(fake_state.FakeStateError) as e:
        fake_state.parse(json.dumps({"apiVersion": fake_state.API_VERSION, "gpus": [gpu_doc(**extra)]}))
    assert fragment in str(e.value) and "fake-gpu fault --clear --gpu 0" in str(e.value)


def test_health_round_trips_through_the_state_file_and_healthy_gpus_carry_no_health_fields():
    inv = build(Inventory(), 3, "P", 1024, random.Random(1))
    broken = Inventory((inv.gpus[0], replace(inv.gpus[1], health="Lost", health_reason="Xid 79 (GPU has fallen off the bus)"),
                        replace(inv.gpus[2], health="Unhealthy", health_reason="Xid 48 (double-bit ECC error)")))
    text = fake_state.render(broken)
    assert "health" not in json.loads(text)["gpus"][0]
    assert fake_state.parse(text).gpus == broken.gpus
    doc = json.loads(text)
    del doc["gpus"][2]["healthReason"]
    assert fake_state.parse(json.dumps(doc)).gpus[2].health_reason == "fault injected by fake-gpu"


def test_the_fake_source_reports_a_fault_while_the_file_carries_it_and_healthy_at_the_next_read_after(tmp_path):
    path = tmp_path / "gpus.json"
    assert fake_gpu(["--state-file", str(path), "set", "--count", "2"]) == 0
    source = FakeFileSource(path)  # the fake's recovery: 0 s
    assert (source.tracker.recovery, source.tracker.source) == (0.0, "fake")
    assert [g.health for g in source.read().inventory.gpus] == ["Healthy", "Healthy"]
    assert fake_gpu(["--state-file", str(path), "fault", "--gpu", "1", "--xid", "48"]) == 0
    reading = source.read()
    assert [(g.health, g.health_reason) for g in reading.inventory.gpus] == [
        ("Healthy", ""), ("Unhealthy", "Xid 48 (double-bit ECC error)")]
    assert reading.inventory.gpus[1].health_since > 0 and len(reading.inventory.healthy) == 1
    assert source.read().inventory.gpus[1].health == "Unhealthy"  # it holds while the file says so
    assert fake_gpu(["--state-file", str(path), "fault", "--gpu", "1", "--lost"]) == 0
    assert source.read().inventory.gpus[1].health == "Lost"
    assert fake_gpu(["--state-file", str(path), "fault", "--clear"]) == 0
    assert [g.health for g in source.read().inventory.gpus] == ["Healthy", "Healthy"]


def test_a_recovery_window_set_for_the_fake_source_holds_a_cleared_gpu_unhealthy(tmp_path):
    from gpu_agent.foundations.clock import ManualClock
    from gpu_agent.mechanisms.inventory.gpu_health import HealthTracker

    path = tmp_path / "gpus.json"
    assert fake_gpu(["--state-file", str(path), "set", "--count", "1"]) == 0
    clock = ManualClock()
    source = FakeFileSource(path, HealthTracker(clock=clock, recovery=5, source="fake"))
    assert fake_gpu(["--state-file", str(path), "fault", "--gpu", "0", "--ecc", "double"]) == 0
    assert source.read().inventory.gpus[0].health == "Unhealthy"
    assert fake_gpu(["--state-file", str(path), "fault", "--clear", "--gpu", "0"]) == 0
    clock.advance_blocking(4.9)
    assert source.read().inventory.gpus[0].health == "Unhealthy"
    clock.advance_blocking(0.1)
    assert source.read().inventory.gpus[0].health == "Healthy"


def test_an_unchanged_state_file_is_parsed_once_and_a_rewritten_one_again(tmp_path, monkeypatch):
    """The writer replaces the file by rename: an unchanged (inode, mtime, size) is unchanged content, and most
    polls skip the read and the parse."""
    path = tmp_path / "gpus.json"
    parsed = []
    read = fake_state.read
    monkeypatch.setattr(fake_state, "read", lambda p: parsed.append(p) or read(p))
    source = FakeFileSource(path)
    assert "does not exist" in source.read().error and "does not exist" in source.read().error
    assert len(parsed) == 2  # no file, nothing to remember: each read looks again
    assert fake_gpu(["--state-file", str(path), "set", "--count", "2"]) == 0
    parsed.clear()  # fake-gpu's own reads
    assert source.read().inventory.count == 2 and source.read().inventory.count == 2
    assert len(parsed) == 1
    assert fake_gpu(["--state-file", str(path), "set", "--count", "3"]) == 0
    parsed.clear()
    assert source.read().inventory.count == 3 and len(parsed) == 1


def test_a_state_file_that_lists_no_gpus_says_so_naming_the_file(tmp_path):
    """The note is the reason of the agent's zero (its NotReady reason; the cluster agent's exit without gracefulNoGPU)."""
    path = tmp_path / "gpus.json"
    assert fake_gpu(["--state-file", str(path), "set", "--count", "0"]) == 0
    assert FakeFileSource(path).read().note == f"fake GPU state file {path} lists no GPUs"
    assert fake_gpu(["--state-file", str(path), "set", "--count", "1"]) == 0
    assert FakeFileSource(path).read().note is None
