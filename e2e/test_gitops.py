"""GitOps health of a release, as Flux and kubectl-based tooling compute it: sigs.k8s.io/cli-utils' kstatus itself
(e2e/gitops.py, the Go tool in ci/kstatus), over the live objects.

A platform team that installs the chart with `helm install --wait` (or lets Flux's helm-controller do it) then
watches the release through kstatus: every object of the release must be Current the moment Helm returns, or a
pipeline that gates on it waits, or fails, for nothing. The objects are the release's manifest (`helm get
manifest`: no hooks, which Helm has deleted by then) and the chart's CRDs (crds/, which the manifest leaves out),
read back from the API server."""

from __future__ import annotations

import subprocess
import time

import yaml

from e2e.cluster import tool
from e2e.gitops import kstatus, live, table
from e2e.release import CHART, WAIT, Release, helm


def test_every_object_of_a_fresh_install_with_wait_is_current_the_moment_helm_returns(
        api, core, apps, kubeconfig, namespace, fake_gpus):
    fake_gpus.set(2)
    release = Release(api, core, apps, kubeconfig, namespace, name="gitops-kstatus")
    kubectl = [tool("kubectl"), "--kubeconfig", release.kubeconfig]
    crds = [yaml.safe_load(p.read_text())["metadata"]["name"] for p in sorted((CHART / "crds").glob("*.yaml"))]
    try:
        started = time.monotonic()
        # With a domain: Helm 4's --wait is kstatus too, so it returns once the GPUDomain is Ready as well.
        helm("install", *release.args("--set", "domain.name=gpus", "--set", "domain.expectedNodes=1"), *WAIT)
        took = time.monotonic() - started
        manifest = helm("get", "manifest", "--kubeconfig", release.kubeconfig, "-n", namespace, release.name).stdout
        objects = live(manifest, namespace, kubectl=kubectl[0], kubeconfig=release.kubeconfig)
        crd_objects = subprocess.run([*kubectl, "get", "crd", *crds, "-o", "json"], capture_output=True, text=True,
                                     check=True, timeout=60).stdout
        rows = kstatus([*objects, yaml.safe_load(crd_objects)])
        print(f"\nhelm install --wait returned after {took:.1f} s; kstatus of its {len(rows)} objects at once:\n"
              f"{table(rows)}")
        rendered = [d for d in yaml.safe_load_all(manifest) if d]
        assert len(rows) == len(rendered) + len(crds), "kstatus did not judge every object"
        assert {r["kind"] for r in rows} >= {"Deployment", "DaemonSet", "CustomResourceDefinition", "GPUDomain"}
        assert [r for r in rows if r["status"] != "Current"] == []
    finally:
        release.uninstall_if_installed()
