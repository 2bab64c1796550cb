"""ci/tools/oci_relabel.py: the CI registry's copy of the project image (ci/scripts/e2e.sh registry_up) is the imported
archive with one label added to its config and nothing else changed: the same layers byte for byte (a node that holds
them reuses them), another image ID (the config's digest), so a pull of the copy through a pull Secret never ties the
node's preloaded localhost/gpu-agent:dev to that Secret (KubeletEnsureSecretPulledImages)."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load(name: str):
    # by path: ci/tools is no package on the unit tests' import path
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


oci_image, oci_relabel = load("oci_image"), load("oci_relabel")
NAMES = ["localhost/gpu-agent:dev", "localhost/gpu-agent:0.2.0"]
LABEL = {"io.gpu-agent.ci.copy": "registry"}


def files(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def image(archive_files: dict[str, bytes]) -> tuple[dict, str, dict, dict]:
    """(index, the manifest's digest, the manifest, the config) of a one-image archive."""
    index = json.loads(archive_files["index.json"])
    digests = {entry["digest"] for entry in index["manifests"]}
    assert len(digests) == 1, digests
    digest = digests.pop()
    manifest_raw = archive_files["blobs/sha256/" + digest.split(":")[1]]
    assert sha(manifest_raw) == digest  # the blob is what its name says
    manifest = json.loads(manifest_raw)
    for entry in index["manifests"]:
        assert entry["size"] == len(manifest_raw)
    config_raw = archive_files["blobs/sha256/" + manifest["config"]["digest"].split(":")[1]]
    assert sha(config_raw) == manifest["config"]["digest"] and len(config_raw) == manifest["config"]["size"]
    return index, digest, manifest, json.loads(config_raw)


@pytest.fixture
def archive(tmp_path: Path) -> Path:
    out = tmp_path / "image.oci.tar"
    oci_image.write_archive(out, NAMES, [b"base layer" * 1000, b"app layer" * 500],
                            {"Entrypoint": ["gpu-agent"], "Labels": {"org.opencontainers.image.title": "gpu-agent"}})
    return out


def test_the_copy_keeps_every_layer_byte_for_byte_and_changes_the_config_by_the_label_alone(archive, tmp_path):
    copy = tmp_path / "copy.oci.tar"
    moved = oci_relabel.relabel(archive, copy, LABEL)
    before, after = files(archive), files(copy)
    index0, digest0, manifest0, config0 = image(before)
    index1, digest1, manifest1, config1 = image(after)
    assert moved == {digest0: digest1} and digest1 != digest0
    # another image ID: the config's digest
    assert manifest1["config"]["digest"] != manifest0["config"]["digest"]
    # the layers: the same descriptors, the same bytes, the same diff_ids
    assert manifest1["layers"] == manifest0["layers"]
    for layer in manifest0["layers"]:
        path = "blobs/sha256/" + layer["digest"].split(":")[1]
        assert after[path] == before[path]
    assert config1["rootfs"] == config0["rootfs"]
    # the config: the label added, nothing else changed
    labels = config1["config"].pop("Labels")
    assert labels == {**config0["config"].pop("Labels"), **LABEL}
    assert config1 == config0
    # the manifest: only its config descriptor; the index: the same names, each on the new manifest
    assert {k: v for k, v in manifest1.items() if k != "config"} == {k: v for k, v in manifest0.items() if k != "config"}
    assert [e["annotations"] for e in index1["manifests"]] == [e["annotations"] for e in index0["manifests"]]
    assert [{k: v for k, v in e.items() if k not in ("digest", "size")} for e in index1["manifests"]] == \
           [{k: v for k, v in e.items() if k not in ("digest", "size")} for e in index0["manifests"]]
    # nothing left of the old manifest and config, nothing else added
    old = {"blobs/sha256/" + d.split(":")[1] for d in (digest0, manifest0["config"]["digest"])}
    new = {"blobs/sha256/" + d.split(":")[1] for d in (digest1, manifest1["config"]["digest"])}
    assert set(after) == (set(before) - old) | new
    assert after["oci-layout"] == before["oci-layout"]


def test_a_config_without_labels_gets_them_and_the_command_line_prints_its_time(tmp_path):
    src, copy = tmp_path / "pause.oci.tar", tmp_path / "copy.oci.tar"
    oci_image.write_archive(src, ["localhost/pause:ci"], [b"pause"], {})
    r = subprocess.run([sys.executable, str(TOOLS / "oci_relabel.py"), str(src), str(copy), "--label", "a=b",
                        "--label", "c=d=e"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "oci_relabel: wrote" in r.stderr and "a=b, c=d=e" in r.stderr
    assert image(files(copy))[3]["config"]["Labels"] == {"a": "b", "c": "d=e"}
    assert not (tmp_path / "copy.oci.tar.tmp").exists()


def test_an_archive_listing_an_image_index_is_refused_by_name(tmp_path):
    src = tmp_path / "multi.oci.tar"
    inner = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                        "manifests": []}).encode()
    index = {"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.index.v1+json",
                                                "digest": sha(inner), "size": len(inner)}]}
    with tarfile.open(src, "w") as tar:
        for name, data in (("oci-layout", b'{"imageLayoutVersion": "1.0.0"}'),
                           ("index.json", json.dumps(index).encode()),
                           ("blobs/sha256/" + sha(inner).split(":")[1], inner)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(SystemExit, match="image index"):
        oci_relabel.relabel(src, tmp_path / "copy.oci.tar", LABEL)
    assert not (tmp_path / "copy.oci.tar").exists()


@pytest.mark.skipif(shutil.which("skopeo") is None, reason="skopeo is not installed (ci/scripts/install-deps.sh)")
def test_skopeo_reads_the_copy_under_each_name_with_the_label_and_the_same_layers(archive, tmp_path):
    copy = tmp_path / "copy.oci.tar"
    oci_relabel.relabel(archive, copy, LABEL)

    def inspect(path: Path, ref: str, *flags: str) -> dict:
        r = subprocess.run(["skopeo", "inspect", *flags, f"oci-archive:{path}:{ref}"], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    for ref in ("dev", "0.2.0"):
        original, relabelled = inspect(archive, ref), inspect(copy, ref)
        assert relabelled["Layers"] == original["Layers"]
        assert relabelled["Digest"] != original["Digest"]
        assert relabelled["Labels"] == {**original["Labels"], **LABEL}
        assert inspect(copy, ref, "--config")["config"]["Labels"] == relabelled["Labels"]
