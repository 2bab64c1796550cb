"""Copy an OCI image archive (ci/tools/oci_image.py's) as a distinct image: the same layers, a config with labels added.

    python3 ci/tools/oci_relabel.py SRC.tar DEST.tar --label KEY=VALUE [--label ...]

Only the config blob changes (its `config.Labels`), and with it the manifest that names it and the index entries that
name that manifest; every layer blob is copied byte for byte (no recompression: their digests and the config's
diff_ids stay), so a store that holds SRC's layers reuses them for DEST. What changes is the image ID (the config's
digest) and the manifest's digest.

Why (ci/scripts/e2e.sh registry_up): the CI cluster imports SRC into every node as localhost/gpu-agent:dev and pushes
DEST to its registry. Pushed from SRC itself, the registry's image would have the imported image's ID; a kubelet
(KubeletEnsureSecretPulledImages, Kubernetes >= 1.35 by default) that pulls it through a pull Secret records that
image ID as one that needs those credentials, and from then on refuses to start that node's pods that use
localhost/gpu-agent:dev with pullPolicy Never without them (ErrImageNeverPull). A distinct ID keeps the registry's image
apart from the preloaded one, as on an air-gapped cluster whose mirror is the only source.

An archive holds an OCI layout (oci-layout, index.json, blobs/sha256/...); its index lists image manifests (one entry
per name); a nested image index is refused by name. The output is written next to DEST and renamed into place.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

INDEX_TYPES = ("application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json")


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _blob_path(digest: str) -> str:
    algorithm, _, hexa = digest.partition(":")
    if algorithm != "sha256" or not hexa:
        raise SystemExit(f"oci_relabel: digest {digest!r} is not sha256: not supported")
    return f"blobs/sha256/{hexa}"


def _dump(document: dict[str, Any]) -> bytes:
    return json.dumps(document, separators=(",", ":")).encode()


def relabel(src: Path, dest: Path, labels: dict[str, str]) -> dict[str, str]:
    """Write DEST from SRC with `labels` added to every image's config; returns {old manifest digest: new}."""
    with tarfile.open(src, "r:") as tar:
        members = {m.name.removeprefix("./"): m for m in tar.getmembers()}

        def read(name: str) -> bytes:
            member = members.get(name)
            f = tar.extractfile(member) if member is not None else None
            if f is None:
                raise SystemExit(f"oci_relabel: {src} has no file {name}")
            return f.read()

        index = json.loads(read("index.json"))
        replaced: dict[str, bytes] = {}  # the blobs written anew, by path
        dropped: set[str] = set()  # the old manifests and configs, by path
        moved: dict[str, str] = {}  # old manifest digest -> new
        for entry in index.get("manifests", []):
            old = entry["digest"]
            if entry.get("mediaType") in INDEX_TYPES:
                raise SystemExit(f"oci_relabel: {src} lists an image index ({old}): only image manifests are supported")
            if old not in moved:
                raw = read(_blob_path(old))
                if _sha(raw) != old:
                    raise SystemExit(f"oci_relabel: {src}: the manifest {old} does not match its digest")
                manifest = json.loads(raw)
                if manifest.get("mediaType") in INDEX_TYPES or "config" not in manifest:
                    raise SystemExit(f"oci_relabel: {src}: {old} is not an image manifest: not supported")
                config_raw = read(_blob_path(manifest["config"]["digest"]))
                config = json.loads(config_raw)
                container = config.setdefault("config", {})
                container["Labels"] = {**(container.get("Labels") or {}), **labels}
                new_config = _dump(config)
                manifest["config"] = {**manifest["config"], "digest": _sha(new_config), "size": len(new_config)}
                new_manifest = _dump(manifest)
                dropped.update((_blob_path(old), _blob_path(_sha(config_raw))))
                replaced[_blob_path(_sha(new_config))] = new_config
                replaced[_blob_path(_sha(new_manifest))] = new_manifest
                moved[old] = _sha(new_manifest)
            entry["digest"] = moved[old]
            entry["size"] = len(replaced[_blob_path(moved[old])])
        if not moved:
            raise SystemExit(f"oci_relabel: {src} lists no image")
        # a layer that is also an old config or manifest (never in practice) must stay
        for path in list(dropped):
            if any(_blob_path(layer["digest"]) == path for raw in replaced.values()
                   for layer in json.loads(raw).get("layers", [])):
                dropped.discard(path)

        tmp = dest.with_name(dest.name + ".tmp")
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tmp, "w:", format=tarfile.PAX_FORMAT) as out:
            def add(path: str, data: bytes) -> None:
                info = tarfile.TarInfo(path)
                info.size, info.mode = len(data), 0o644
                out.addfile(info, io.BytesIO(data))
            add("index.json", json.dumps(index).encode())
            for name, member in members.items():
                if name == "index.json" or name in dropped or name in replaced:
                    continue
                if member.isfile():  # layers and the rest, byte for byte
                    out.addfile(member, tar.extractfile(member))
                else:
                    out.addfile(member)
            for path, data in replaced.items():
                add(path, data)
        tmp.rename(dest)
    return moved


def main() -> int:
    p = argparse.ArgumentParser(prog="oci_relabel", description=__doc__.split("\n\n")[0])
    p.add_argument("src", type=Path)
    p.add_argument("dest", type=Path)
    p.add_argument("--label", action="append", required=True, help="KEY=VALUE, added to each image's config.Labels")
    a = p.parse_args()
    labels = {}
    for item in a.label:
        key, sep, value = item.partition("=")
        if not sep or not key:
            p.error(f"--label wants KEY=VALUE, got {item!r}")
        labels[key] = value
    started = time.monotonic()
    moved = relabel(a.src, a.dest, labels)
    print(f"oci_relabel: wrote {a.dest} from {a.src} in {time.monotonic() - started:.2f}s, labels "
          f"{', '.join(f'{k}={v}' for k, v in labels.items())}: "
          f"{'; '.join(f'manifest {old[:19]}... -> {new[:19]}...' for old, new in moved.items())}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
