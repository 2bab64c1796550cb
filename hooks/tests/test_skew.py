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
