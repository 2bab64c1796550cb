"""Storage migration's order of events, against a scripted API: storedVersions is trimmed only
after every object was rewritten, and never when one could not be."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpu_agent_hooks.migrate import MigrationError, migrate

CRD = {"metadata": {"name": "gpudomains.gpu-agent.io"},
       "spec": {"group": "gpu-agent.io", "names": {"plural": "gpudomains"},
                "versions": [{"name": "v1beta1", "served": True, "storage": True},
                             {"name": "v1alpha1", "served": True, "storage": False}]}}


class Refused(Exception):
    def __init__(self, status):
        super().__init__(f"HTTP {status}")
        self.status = status


class ScriptedApi:
    """Records every call in order; `failures` maps an object name to the statuses its next
    replace calls raise, one per call. Every call must name its timeout (`_request_timeout`, keyword-only and
    required here): a hook's call that a hung API server holds would hold the upgrade."""

    def __init__(self, stored, names, failures=None):
        self.stored, self.names, self.failures, self.calls = stored, names, failures or {}, []

    def read_custom_resource_definition(self, name, *, _request_timeout):
        return SimpleNamespace(status=SimpleNamespace(stored_versions=list(self.stored)))

    def list_cluster_custom_object(self, group, version, plural, *, _request_timeout):
        self.calls.append(("list", version))
        return {"items": [{"metadata": {"namespace": "ns", "name": n, "resourceVersion": "1"}} for n in self.names]}

    def replace_namespaced_custom_object(self, group, version, namespace, plural, name, body, *, _request_timeout):
        self.calls.append(("replace", name, version, body["metadata"]["resourceVersion"]))
        pending = self.failures.get(name) or []
        if pending:
            raise Refused(pending.pop(0))

    def get_namespaced_custom_object(self, group, version, namespace, plural, name, *, _request_timeout):
        self.calls.append(("get", name))
        return {"metadata": {"namespace": namespace, "name": name, "resourceVersion": "2"}}

    def patch_custom_resource_definition_status(self, name, body, _content_type, *, _request_timeout):
        self.calls.append(("trim", body["status"]["storedVersions"], _content_type))


def test_every_object_is_rewritten_at_the_storage_version_before_stored_versions_is_trimmed():
    api = ScriptedApi(["v1alpha1", "v1beta1"], ["a", "b", "c"])
    report = migrate(api, api, CRD)
    assert api.calls == [("list", "v1beta1"), ("replace", "a", "v1beta1", "1"), ("replace", "b", "v1beta1", "1"),
                         ("replace", "c", "v1beta1", "1"), ("trim", ["v1beta1"], "application/merge-patch+json")]
    assert "migrated 3 object(s)" in report and "-> [v1beta1]" in report


def test_a_conflict_reads_the_object_again_and_a_deleted_one_is_passed_over():
    api = ScriptedApi(["v1alpha1"], ["a", "b"], failures={"a": [409], "b": [404]})
    report = migrate(api, api, CRD)
    assert api.calls == [("list", "v1beta1"), ("replace", "a", "v1beta1", "1"), ("get", "a"),
                         ("replace", "a", "v1beta1", "2"), ("replace", "b", "v1beta1", "1"),
                         ("trim", ["v1beta1"], "application/merge-patch+json")]
    assert "migrated 1 object(s) to v1beta1 (1 deleted meanwhile)" in report


@pytest.mark.parametrize("failures", [{"b": [500]}, {"b": [409] * 5}])
def test_a_failed_rewrite_leaves_stored_versions_alone(failures):
    api = ScriptedApi(["v1alpha1", "v1beta1"], ["a", "b", "c"], failures=failures)
    with pytest.raises(MigrationError) as e:
        migrate(api, api, CRD)
    assert not [c for c in api.calls if c[0] == "trim"]
    assert "storedVersions left at ['v1alpha1', 'v1beta1']" in str(e.value) or "kept changing" in str(e.value)


def test_nothing_to_do_when_only_the_storage_version_is_stored():
    api = ScriptedApi(["v1beta1"], ["a"])
    assert "nothing to migrate" in migrate(api, api, CRD)
    assert api.calls == []
