import pytest

from gpu_agent_hooks.skew import SkewError, check_stored_versions, check_versions


@pytest.mark.parametrize("deployed,target", [("0.1.0", "0.1.0"), ("0.1.0", "0.2.0"), ("0.9.3", "1.0.0"),
                                             ("1.4.0", "1.3.2"), ("1.4.1", "1.4.0")])
def test_allowed_changes(deployed, target):
    assert check_versions(deployed, target)


@pytest.mark.parametrize("deployed,target,words", [
    ("0.3.0", "2.0.0", "skips major version 1"),
    ("2.0.0", "1.9.0", "crosses a major version"),
    ("1.5.0", "1.3.0", "more than one minor version"),
    ("1.5.0", "latest", "cannot read version"),
])
def test_refused_changes_say_why_and_how(deployed, target, words):
    with pytest.raises(SkewError, match=words):
        check_versions(deployed, target)


CHART_CRD = {"metadata": {"name": "gpudomains.gpu-agent.io"}, "spec": {
    "names": {"kind": "GPUDomain"}, "versions": [{"name": "v1alpha1", "served": True}, {"name": "v1beta1", "served": True}]}}


def test_stored_versions_must_be_served():
    assert "not installed" in check_stored_versions(None, CHART_CRD)
    assert "all served" in check_stored_versions({"status": {"storedVersions": ["v1alpha1"]}}, CHART_CRD)
    with pytest.raises(SkewError, match="stored at version\\(s\\) v1"):
        check_stored_versions({"status": {"storedVersions": ["v1", "v1alpha1"]}}, CHART_CRD)


def crd(storage, *served, name="gpudomains.gpu-agent.io"):
    return {"metadata": {"name": name}, "spec": {"versions": [
        {"name": v, "served": True, "storage": v == storage} for v in served]}}


def test_a_release_may_store_only_what_the_previous_release_served():
    from gpu_agent_hooks.skew import check_storage_follows_previous_release as rule
    # 0.2: serves the new version, still stores the old one; 0.3 may then store the new one.
    assert "stores v1alpha1" in rule([crd("v1alpha1", "v1alpha1")], [crd("v1alpha1", "v1alpha1", "v1beta1")], "0.1.0")[0]
    assert "stores v1beta1" in rule([crd("v1alpha1", "v1alpha1", "v1beta1")], [crd("v1beta1", "v1alpha1", "v1beta1")], "0.2.0")[0]
    assert "new in this release" in rule([], [crd("v1", "v1")], "0.1.0")[0]
    # Serving and storing a new version in the same release breaks the rollback.
    with pytest.raises(SkewError, match=r"stores v1beta1, which 0\.1\.0 does not serve.*store it in the next"):
        rule([crd("v1alpha1", "v1alpha1")], [crd("v1beta1", "v1alpha1", "v1beta1")], "0.1.0")
    # Dropping the previous release's storage version breaks the upgrade.
    with pytest.raises(SkewError, match=r"no longer serves v1alpha1, which 0\.2\.0 stores"):
        rule([crd("v1alpha1", "v1alpha1", "v1beta1")], [crd("v1beta1", "v1beta1")], "0.2.0")


def test_this_checkouts_crds_keep_the_rule_against_the_last_release():
    """What `make release` runs, on the real chart and the last release's CRDs from git."""
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, str(repo / "scripts" / "crd-storage-rule.py")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("crd-storage-rule:") == 3, r.stdout  # GPUDomain, GPUDomainMember, WorkFence
