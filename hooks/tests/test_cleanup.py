"""The pre-delete cleanup of work Pods: each one's finalizer is removed before it is deleted (the
agent keeps it until the item's ack; once the release is gone nobody else would), every call
bounded by REQUEST_TIMEOUT, a Pod already gone ignored. Proven on the CI cluster by
e2e/test_chart.py (the leftover Pod with the finalizer); here, the calls."""

import pytest
from kubernetes import client

from gpu_agent.foundations.kube import REQUEST_TIMEOUT
from gpu_agent_hooks import cli

RELEASE_PATCH = {"metadata": {"$deleteFromPrimitiveList/finalizers": ["gpu-agent.io/work-item"]}}


def pod(name, finalizers=("gpu-agent.io/work-item",)):
    return client.V1Pod(metadata=client.V1ObjectMeta(name=name, namespace="ns", finalizers=list(finalizers) or None))


class FakeCore:
    def __init__(self, pods, gone=(), fail=None):
        self.pods, self.gone, self.fail, self.calls = pods, set(gone), fail, []

    def list_namespaced_pod(self, namespace, label_selector=None, _request_timeout=None):
        self.calls.append(("list", namespace, label_selector, _request_timeout))
        return client.V1PodList(items=self.pods)

    def _answer(self, name):
        if name in self.gone:
            raise client.ApiException(status=404, reason="Not Found")
        if self.fail is not None and name == self.fail[0]:
            raise client.ApiException(status=self.fail[1], reason="Forbidden")

    def patch_namespaced_pod(self, name, namespace, body, _content_type=None, _request_timeout=None):
        self.calls.append(("patch", name, namespace, body, _content_type, _request_timeout))
        self._answer(name)

    def delete_namespaced_pod(self, name, namespace, grace_period_seconds=None, _request_timeout=None):
        self.calls.append(("delete", name, namespace, grace_period_seconds, _request_timeout))
        self._answer(name)


def test_each_work_pod_of_the_release_is_released_then_deleted_with_a_timeout_on_every_call():
    core = FakeCore([pod("gpu-work-a"), pod("gpu-work-b", finalizers=())])
    assert cli.delete_work_pods_of(core, "ns", "ga") == 2
    merge = "application/strategic-merge-patch+json"
    assert core.calls == [
        ("list", "ns", "gpu-agent.io/work-item=true,app.kubernetes.io/instance=ga", REQUEST_TIMEOUT),
        ("patch", "gpu-work-a", "ns", RELEASE_PATCH, merge, REQUEST_TIMEOUT),
        ("delete", "gpu-work-a", "ns", 0, REQUEST_TIMEOUT),
        # a Pod without the finalizer (one a person made, an older agent's): the patch is a no-op, then deleted
        ("patch", "gpu-work-b", "ns", RELEASE_PATCH, merge, REQUEST_TIMEOUT),
        ("delete", "gpu-work-b", "ns", 0, REQUEST_TIMEOUT),
    ]


def test_a_pod_gone_meanwhile_is_skipped_and_the_others_are_still_cleaned():
    core = FakeCore([pod("gpu-work-gone"), pod("gpu-work-here")], gone={"gpu-work-gone"})
    assert cli.delete_work_pods_of(core, "ns", "ga") == 2
    assert [(c[0], c[1]) for c in core.calls[1:]] == [
        ("patch", "gpu-work-gone"), ("delete", "gpu-work-gone"), ("patch", "gpu-work-here"), ("delete", "gpu-work-here")]


def test_a_refused_release_is_an_error_and_the_pod_is_not_deleted_behind_it():
    # Deleting a Pod whose finalizer stays would only leave it Terminating: the step fails, saying why.
    core = FakeCore([pod("gpu-work-a")], fail=("gpu-work-a", 403))
    with pytest.raises(client.ApiException) as e:
        cli.delete_work_pods_of(core, "ns", "ga")
    assert e.value.status == 403
    assert [c[0] for c in core.calls] == ["list", "patch"]


def test_the_cleanup_step_reports_how_many_work_pods_it_released(monkeypatch, capsys, tmp_path):
    core = FakeCore([pod("gpu-work-a")])
    monkeypatch.setattr(cli.client, "CoreV1Api", lambda api: core)
    monkeypatch.setattr(cli.client, "CustomObjectsApi", lambda api: type("C", (), {
        "list_namespaced_custom_object": lambda self, *a, **k: {"items": []}})())
    cli.cleanup(None, "ns", "ga", "ga", "http://127.0.0.1:9", tmp_path / "absent", timeout=5)
    out = capsys.readouterr().out
    assert "1 work pod(s) released (finalizer removed) and deleted" in out
    assert "cleanup work pods: ok" in out
    assert ("delete", "gpu-work-a", "ns", 0, REQUEST_TIMEOUT) in core.calls


class FakeResource:
    def __init__(self, names, gone=()):
        self.names, self.gone, self.calls = names, set(gone), []

    def list_namespaced_resource_claim_template(self, namespace, label_selector=None, _request_timeout=None):
        self.calls.append(("list", namespace, label_selector, _request_timeout))
        return client.V1PodList(items=[client.V1Pod(metadata=client.V1ObjectMeta(name=n)) for n in self.names])

    def delete_namespaced_resource_claim_template(self, name, namespace, _request_timeout=None):
        self.calls.append(("delete", name, namespace, _request_timeout))
        if name in self.gone:
            raise client.ApiException(status=404, reason="Not Found")


def test_the_work_claim_templates_of_the_release_are_deleted_only_when_asked(monkeypatch, capsys, tmp_path):
    resource = FakeResource(["ga-work-gpus-1", "ga-work-gpus-2"], gone={"ga-work-gpus-1"})
    monkeypatch.setattr(cli.client, "CoreV1Api", lambda api: FakeCore([]))
    monkeypatch.setattr(cli.client, "ResourceV1Api", lambda api: resource)
    monkeypatch.setattr(cli.client, "CustomObjectsApi", lambda api: type("C", (), {
        "list_namespaced_custom_object": lambda self, *a, **k: {"items": []}})())
    cli.cleanup(None, "ns", "ga", "ga", "http://127.0.0.1:9", tmp_path / "absent", timeout=5)
    assert resource.calls == []  # dra off: the hook has no right to them, and there are none
    cli.cleanup(None, "ns", "ga", "ga", "http://127.0.0.1:9", tmp_path / "absent", timeout=5, work_claim_templates=True)
    assert resource.calls == [
        ("list", "ns", "gpu-agent.io/work-claim=true,app.kubernetes.io/instance=ga", REQUEST_TIMEOUT),
        ("delete", "ga-work-gpus-1", "ns", REQUEST_TIMEOUT), ("delete", "ga-work-gpus-2", "ns", REQUEST_TIMEOUT)]
    out = capsys.readouterr().out
    assert "2 work ResourceClaimTemplate(s) deleted" in out and "cleanup work claim templates: ok" in out
