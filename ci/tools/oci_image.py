"""Build OCI image archives without a container engine, for `ctr images import`.

Two entry points:
  layers   an image from ready-made layer tarballs or folders (the pause and CoreDNS images)
  build    a Dockerfile subset (ARG FROM ENV WORKDIR COPY RUN USER ENTRYPOINT CMD LABEL EXPOSE),
           with FROM resolved to a local base rootfs tarball; RUN executes in a chroot of the
           base plus the earlier steps. The result is the base layer plus one layer of
           everything the steps changed, so the same Dockerfile serves `docker build`.

Only what this project's images need is supported; anything else is refused by name.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def tar_folder(folder: Path, only: set[str] | None = None) -> bytes:
    """A reproducible uncompressed tar of `folder` (optionally only the relative paths in `only`)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for root, dirs, files in os.walk(folder):
            dirs.sort()
            for name in sorted(dirs) + sorted(files):
                full = Path(root) / name
                rel = full.relative_to(folder).as_posix()
                if only is not None and rel not in only:
                    continue
                info = tar.gettarinfo(str(full), arcname=rel)
                info.uname = info.gname = ""
                info.mtime = 0
                if info.isreg():
                    with open(full, "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
    return buf.getvalue()


def write_archive(out: Path, names: list[str], layers: list[bytes], config: dict[str, Any], created: str = "1970-01-01T00:00:00Z") -> None:
    """One image, under each of `names` (the index lists the manifest once per name: `ctr images import`,
    `kind load image-archive` and `k3d image import` name it with every one)."""
    blobs: dict[str, bytes] = {}
    diff_ids, layer_descs = [], []
    for raw in layers:
        diff_ids.append(_sha(raw))
        gz = gzip.compress(raw, compresslevel=1, mtime=0)
        digest = _sha(gz)
        blobs[digest] = gz
        layer_descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": digest, "size": len(gz)})
    image_config = json.dumps({"architecture": "amd64", "os": "linux", "created": created, "config": config,
                               "rootfs": {"type": "layers", "diff_ids": diff_ids}}, sort_keys=True).encode()
    blobs[_sha(image_config)] = image_config
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                      "digest": _sha(image_config), "size": len(image_config)},
                           "layers": layer_descs}, sort_keys=True).encode()
    blobs[_sha(manifest)] = manifest
    index = {"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": _sha(manifest), "size": len(manifest),
        "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1]},
        "platform": {"architecture": "amd64", "os": "linux"}} for name in names]}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with tarfile.open(tmp, "w") as tar:
        def add(path: str, data: bytes) -> None:
            info = tarfile.TarInfo(path)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        add("oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
        add("index.json", json.dumps(index).encode())
        for digest, data in blobs.items():
            add("blobs/sha256/" + digest.split(":", 1)[1], data)
    tmp.rename(out)


def _snapshot(root: Path) -> dict[str, tuple[int, int, int]]:
    state = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            st = p.lstat()
            state[p.relative_to(root).as_posix()] = (st.st_mtime_ns, st.st_size, st.st_mode)
    return state


class DockerfileBuild:
    def __init__(self, context: Path, base_tar: Path, args: dict[str, str]) -> None:
        self.context = context
        self.base_tar = base_tar
        self.args = dict(args)
        self.env: dict[str, str] = {}
        self.config: dict[str, Any] = {"Env": [], "Labels": {}, "ExposedPorts": {}}
        self.workdir = "/"

    def _expand(self, text: str) -> str:
        for k, v in sorted({**self.args, **self.env}.items(), key=lambda kv: -len(kv[0])):
            text = text.replace("${" + k + "}", v).replace("$" + k, v)
        return text

    def run(self, dockerfile: Path) -> tuple[bytes, bytes, dict[str, Any]]:
        lines, pending = [], ""
        for raw in dockerfile.read_text().splitlines():
            if raw.strip().startswith("#") or not raw.strip():
                continue
            if raw.rstrip().endswith("\\"):
                pending += raw.rstrip()[:-1] + " "
                continue
            lines.append((pending + raw).strip())
            pending = ""
        with tempfile.TemporaryDirectory(prefix="oci-build-") as tmp:
            root = Path(tmp) / "rootfs"
            root.mkdir()
            subprocess.run(["tar", "-xpf", str(self.base_tar), "-C", str(root)], check=True)
            before = _snapshot(root)
            for line in lines:
                op, _, rest = line.partition(" ")
                op = op.upper()
                if op == "ARG":
                    name, _, default = rest.partition("=")
                    self.args.setdefault(name.strip(), default.strip())
                elif op == "FROM":
                    continue  # resolved to the local base rootfs by the caller
                elif op == "ENV":
                    k, _, v = rest.partition("=")
                    self.env[k.strip()] = self._expand(v.strip().strip('"'))
                elif op == "WORKDIR":
                    self.workdir = self._expand(rest.strip())
                    (root / self.workdir.lstrip("/")).mkdir(parents=True, exist_ok=True)
                elif op == "COPY":
                    parts = shlex.split(rest)
                    parts = [p for p in parts if not p.startswith("--")]
                    *srcs, dest = parts
                    target = root / self._expand(dest).lstrip("/")
                    for src in srcs:
                        s = self.context / src
                        if s.is_dir():  # like Docker: a folder's contents go into dest
                            shutil.copytree(s, target, dirs_exist_ok=True, symlinks=True)
                        else:
                            dst = target / s.name if dest.endswith("/") else target
                            dst.parent.mkdir(parents=True, exist_ok=True)
                            shutil.copy2(s, dst)
                elif op == "RUN":
                    self._run_in_chroot(root, self._expand(rest))
                elif op == "USER":
                    self.config["User"] = rest.strip()
                elif op in ("ENTRYPOINT", "CMD"):
                    self.config["Entrypoint" if op == "ENTRYPOINT" else "Cmd"] = json.loads(rest)
                elif op == "LABEL":
                    for item in shlex.split(rest):
                        k, _, v = item.partition("=")
                        self.config["Labels"][k] = self._expand(v)
                elif op == "EXPOSE":
                    for port in rest.split():
                        self.config["ExposedPorts"][port if "/" in port else port + "/tcp"] = {}
                else:
                    raise SystemExit(f"oci_image: Dockerfile instruction {op} is not supported by the local builder")
            after = _snapshot(root)
            changed = {p for p, st in after.items() if before.get(p) != st}
            # a changed file needs its parent folders in the layer too
            for p in list(changed):
                parts = p.split("/")
                changed.update("/".join(parts[:i]) for i in range(1, len(parts)))
            app_layer = tar_folder(root, changed)
        with open(self.base_tar, "rb") as f:
            base_layer = f.read()
        self.config["Env"] = [f"{k}={v}" for k, v in self.env.items()]
        self.config["WorkingDir"] = self.workdir
        return base_layer, app_layer, self.config

    def _run_in_chroot(self, root: Path, command: str) -> None:
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", **self.env}
        (root / "proc").mkdir(exist_ok=True)
        (root / "dev").mkdir(exist_ok=True)
        subprocess.run(["mount", "-t", "proc", "proc", str(root / "proc")], check=True)
        subprocess.run(["mount", "--rbind", "/dev", str(root / "dev")], check=True)
        try:
            r = subprocess.run(["chroot", str(root), "/bin/sh", "-c", f"cd {shlex.quote(self.workdir)} && {command}"], env=env)
        finally:
            subprocess.run(["umount", "-l", str(root / "dev")], check=False)
            subprocess.run(["umount", "-l", str(root / "proc")], check=False)
        if r.returncode:
            raise SystemExit(f"oci_image: RUN {command!r} failed with exit code {r.returncode}")


def main() -> int:
    p = argparse.ArgumentParser(prog="oci_image")
    sub = p.add_subparsers(dest="cmd", required=True)
    lp = sub.add_parser("layers")
    lp.add_argument("--name", required=True, action="append", help="repeat for more names of the same image")
    lp.add_argument("--out", type=Path, required=True)
    lp.add_argument("--layer", action="append", type=Path, required=True, help="a folder or a .tar")
    lp.add_argument("--entrypoint", default=None, help="JSON list")
    lp.add_argument("--user", default=None)
    bp = sub.add_parser("build")
    bp.add_argument("--name", required=True, action="append", help="repeat for more names of the same image")
    bp.add_argument("--out", type=Path, required=True)
    bp.add_argument("--file", type=Path, required=True)
    bp.add_argument("--context", type=Path, required=True)
    bp.add_argument("--base-rootfs", type=Path, required=True, help="tarball the FROM line resolves to")
    bp.add_argument("--build-arg", action="append", default=[])
    a = p.parse_args()
    if a.cmd == "layers":
        layers = [tar_folder(x) if x.is_dir() else x.read_bytes() for x in a.layer]
        config: dict[str, Any] = {}
        if a.entrypoint:
            config["Entrypoint"] = json.loads(a.entrypoint)
        if a.user:
            config["User"] = a.user
        write_archive(a.out, a.name, layers, config)
    else:
        args = dict(x.split("=", 1) for x in a.build_arg)
        base, app, config = DockerfileBuild(a.context, a.base_rootfs, args).run(a.file)
        write_archive(a.out, a.name, [base, app], config)
    print(f"oci_image: wrote {a.out} ({a.out.stat().st_size / 2**20:.1f} MiB) as {', '.join(a.name)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
