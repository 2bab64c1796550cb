"""Tokens rotated without a restart (issue 48, part 4), as `helm template` renders them: every Secret volume of every
pod is a plain mount, never a subPath one (the kubelet never updates a subPath mount: a rotated token would stay
unseen until a restart), and the reference control plane gets its overlap from controlPlane.tokenOverlap."""

from __future__ import annotations

import pytest
from test_least_privilege import VALUE_SETS, pod_specs, render, secret_volumes


@pytest.mark.parametrize("case", list(VALUE_SETS))
def test_no_secret_volume_is_mounted_with_subpath(case):
    checked = 0
    for name, spec in pod_specs(render(*VALUE_SETS[case])).items():
        secrets = {volume for volume, _source, _mode in secret_volumes(spec)}
        for container in spec["containers"] + spec.get("initContainers", []):
            for mount in container.get("volumeMounts", []):
                if mount["name"] in secrets:
                    checked += 1
                    assert "subPath" not in mount and "subPathExpr" not in mount, \
                        f"{name}/{container['name']} mounts Secret volume {mount['name']} with a subPath: never updated"
    assert checked >= 2, checked


@pytest.mark.parametrize(("sets", "flag"), [([], "--token-overlap=600"),
                                            (["--set", "controlPlane.tokenOverlap=30"], "--token-overlap=30")])
def test_the_control_plane_takes_its_token_overlap_from_the_values(sets, flag):
    (cp,) = [d for d in render(*sets) if d["kind"] == "Deployment" and d["metadata"]["name"] == "t-gpu-agent-control-plane"]
    assert flag in cp["spec"]["template"]["spec"]["containers"][0]["args"]
