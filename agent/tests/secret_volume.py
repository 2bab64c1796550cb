"""A Kubernetes Secret volume as the kubelet's atomic writer lays it out, for the tests of tokens rotated without a
restart: `..<timestamp>/<key>` files, `..data` a link to the newest folder, and each `<key> -> ..data/<key>`. An
update writes a new folder, renames a new `..data` link over the old one (the one atomic step: a reader by path
sees the old files or the new, never half) and removes the old folder, as the kubelet does."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

_stamps = itertools.count(1)


class SecretVolume:
    def __init__(self, root: Path, data: dict[str, str]) -> None:
        self.root = root
        root.mkdir(parents=True)
        self.update(data)
        for key in data:
            os.symlink(f"..data/{key}", root / key)

    def path(self, key: str) -> Path:
        return self.root / key

    def update(self, data: dict[str, str]) -> None:
        folder = f"..2026_12_07_21_00_{next(_stamps):02d}.{os.getpid()}"
        (self.root / folder).mkdir(mode=0o755)
        for key, value in data.items():
            (self.root / folder / key).write_text(value)
            os.chmod(self.root / folder / key, 0o440)
        link = self.root / "..data"
        old = os.readlink(link) if link.is_symlink() else None
        os.symlink(folder, self.root / "..data_tmp")
        os.replace(self.root / "..data_tmp", link)
        if old:
            for child in (self.root / old).iterdir():
                child.unlink()
            (self.root / old).rmdir()
