"""Each GPUDomain's channel ResourceClaimTemplate (mechanisms/domain/channels.py, issue 47 part 1): the pure plan for
every case (make, keep, remake, clean up, leave a foreign one alone), then the controller against a scripted API
server (each call with its timeout, a conflict told once, retries with backoff, the periodic resync on an injected
clock), and the cluster agent starting and stopping it with the domain folding."""

from __future__ import annotations

import copy
import itertools
import threading
import time

import pytest
from kubernetes.client import ApiException

from gpu_agent.foundations.clock import ManualClock
from gpu_agent.mechanisms.domain.channels import Action, ChannelSettings, ChannelTemplates, plan, template_for

SETTINGS = ChannelSettings(driver="gpu.gpu-agent.io", device_class="channel.gpu-agent.io")
UID = "0b7c4c5e-1111-4a8e-9d55-0f5b1d8b9a10"
OTHER_UID = "9f00aa00-2222-4a8e-9d55-0f5b1d8b9a10"


def gpudomain(channel: dict | None = None, *, name="d1", uid=UID, generation=1, api_version="gpu-agent.io/v1alpha1",
              **meta) -> dict:
    spec: dict = {"expectedNodes": 2}
    if channel is not None:
        spec["channel"] = channel
    return {"apiVersion": api_version, "kind": "GPUDomain", "spec": spec,
            "metadata": {"name": name, "namespace": "ns", "uid": uid, "generation": generation, **meta}}


def channel(name="d1-channel", mode: str | None = None) -> dict:
    out: dict = {"resourceClaimTemplate": {"name": name}}
    if mode is not None:
        out["allocationMode"] = mode
    return out


def read_back(body: dict, uid: str = "t-uid-1") -> dict:
    """A template as the API server hands it back: what was written, with the server's metadata."""
    out = copy.deepcopy(body)
    out["metadata"].update({"uid": uid, "resourceVersion": "17", "creationTimestamp": "2026-01-01T00:00:00Z",
                            "managedFields": [{"manager": "gpu-agent"}]})
    return out


def foreign(name="d1-channel", owner: dict | None = None, uid="t-foreign", **labels) -> dict:
    meta: dict = {"name": name, "namespace": "ns", "uid": uid, "labels": labels}
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": meta,
            "spec": {"spec": {"devices": {"requests": [{"name": "x", "exactly": {"deviceClassName": "y"}}]}}}}


# -- the template and the plan --------------------------------------------------------------------------------------

def test_the_template_is_the_contracts_to_the_letter():
    body = template_for(gpudomain(channel(mode="All")), SETTINGS)
    assert body == {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": "d1-channel", "namespace": "ns",
            "labels": {"gpu-agent.io/domain": "d1", "gpu-agent.io/domain-uid": UID,
                       "app.kubernetes.io/managed-by": "gpu-agent"},
            "ownerReferences": [{"apiVersion": "gpu-agent.io/v1alpha1", "kind": "GPUDomain", "name": "d1", "uid": UID,
                                 "controller": True}]},
        "spec": {"spec": {"devices": {
            "requests": [{"name": "channel", "exactly": {"deviceClassName": "channel.gpu-agent.io",
                                                         "allocationMode": "ExactCount", "count": 1}}],
            "config": [{"requests": ["channel"], "opaque": {"driver": "gpu.gpu-agent.io", "parameters": {
                "apiVersion": "gpu.gpu-agent.io/v1alpha1", "kind": "ChannelConfig", "domain": "d1", "domainUID": UID,
                "allocationMode": "All"}}}]}}}}
    # no blockOwnerDeletion: it would need update rights on gpudomains/finalizers
    assert "blockOwnerDeletion" not in body["metadata"]["ownerReferences"][0]


def test_the_owner_reference_names_the_version_the_domain_was_read_with_and_single_is_the_default_mode():
    body = template_for(gpudomain(channel(), api_version="gpu-agent.io/v1beta1"), SETTINGS)
    assert body["metadata"]["ownerReferences"][0]["apiVersion"] == "gpu-agent.io/v1beta1"
    assert body["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"]["allocationMode"] == "Single"
    unread = gpudomain(channel(mode="Single"))
    del unread["apiVersion"]  # as a watch of typed lists may hand it
    assert template_for(unread, SETTINGS)["metadata"]["ownerReferences"][0]["apiVersion"] == "gpu-agent.io/v1alpha1"


def verbs(actions: list[Action]) -> list[tuple[str, str]]:
    return [(a.verb, a.name) for a in actions]


def test_no_channel_no_template_and_nothing_to_delete():
    assert plan(gpudomain(), [], SETTINGS) == []
    # a template of another domain (its UID label) is never this domain's to delete
    assert plan(gpudomain(), [foreign("x", **{"gpu-agent.io/domain-uid": OTHER_UID})], SETTINGS) == []


def test_a_channel_without_its_template_makes_it():
    domain = gpudomain(channel())
    (create,) = plan(domain, [], SETTINGS)
    assert (create.verb, create.name, create.body) == ("create", "d1-channel", template_for(domain, SETTINGS))


def test_this_domains_template_asking_what_the_domain_asks_is_kept():
    domain = gpudomain(channel(mode="All"))
    assert plan(domain, [read_back(template_for(domain, SETTINGS))], SETTINGS) == []


@pytest.mark.parametrize("change", ["allocationMode", "class", "driver", "label"])
def test_this_domains_template_asking_something_else_is_deleted_and_made_again(change):
    """A template's spec is immutable: another allocationMode, class or driver means a new one."""
    domain = gpudomain(channel(mode="All"))
    settings = SETTINGS
    old = read_back(template_for(domain, SETTINGS), uid="t-old")
    if change == "allocationMode":
        domain = gpudomain(channel(mode="Single"), generation=2)
    elif change == "class":
        settings = ChannelSettings(SETTINGS.driver, "fast-channels")
    elif change == "driver":
        settings = ChannelSettings("gpus.example.com", SETTINGS.device_class)
    else:
        del old["metadata"]["labels"]["gpu-agent.io/domain"]
    delete, create = plan(domain, [old], settings)
    assert (delete.verb, delete.name, delete.uid) == ("delete", "d1-channel", "t-old")  # only the object read
    assert (create.verb, create.name, create.body) == ("create", "d1-channel", template_for(domain, settings))


def test_a_template_of_that_name_that_is_not_this_domains_is_left_alone_as_a_conflict():
    domain = gpudomain(channel())
    other_domain = {"apiVersion": "gpu-agent.io/v1alpha1", "kind": "GPUDomain", "name": "d2", "uid": OTHER_UID,
                    "controller": True}
    for there, why in [
        (foreign(), "it has no controller: someone else made it"),
        (foreign(owner=other_domain), f"its controller is GPUDomain d2 (uid {OTHER_UID})"),
        # our labels copied, but not owned by this domain: still not ours
        (foreign(owner={**other_domain, "controller": False}, **{"gpu-agent.io/domain-uid": UID}),
         "it has no controller: someone else made it"),
        (foreign(owner={"apiVersion": "apps/v1", "kind": "Deployment", "name": "x", "uid": UID, "controller": True}),
         f"its controller is Deployment x (uid {UID})"),
    ]:
        (conflict,) = plan(domain, [there], SETTINGS)
        assert (conflict.verb, conflict.name, conflict.why) == ("conflict", "d1-channel", why)


def test_a_channel_removed_or_renamed_deletes_the_templates_labelled_with_the_domains_uid():
    made = read_back(template_for(gpudomain(channel("old-name")), SETTINGS), uid="t-old")
    another = foreign("other-domains", **{"gpu-agent.io/domain-uid": OTHER_UID})
    removed = plan(gpudomain(generation=2), [made, another], SETTINGS)
    assert [(a.verb, a.name, a.uid, a.why) for a in removed] == [("delete", "old-name", "t-old", "spec.channel removed")]
    renamed = gpudomain(channel("new-name"), generation=2)
    assert verbs(plan(renamed, [made, another], SETTINGS)) == [("delete", "old-name"), ("create", "new-name")]


def test_a_domain_being_deleted_or_without_a_driver_is_left_to_the_garbage_collector():
    made = read_back(template_for(gpudomain(channel()), SETTINGS))
    going = gpudomain(channel("new-name"), deletionTimestamp="2026-01-01T00:00:00Z")
    assert plan(going, [made], SETTINGS) == []
    assert plan(gpudomain(channel("new-name")), [made], ChannelSettings("", "channel.gpu-agent.io")) == []
    assert plan(gpudomain(channel(), uid=""), [], SETTINGS) == []


def test_this_domains_template_being_deleted_is_waited_for():
    domain = gpudomain(channel(mode="All"))
    going = read_back(template_for(domain, SETTINGS))
    going["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert verbs(plan(domain, [going], SETTINGS)) == [("wait", "d1-channel")]


# -- the controller against a scripted API server ------------------------------------------------------------------

class FakeApi:
    """ResourceClaimTemplates of one namespace through the custom-objects calls the controller makes; each call must
    carry a timeout. `fail[verb]`: the exception that call raises (until removed)."""

    def __init__(self, *templates: dict) -> None:
        self.templates = {t["metadata"]["name"]: copy.deepcopy(t) for t in templates}
        self.calls: list[tuple[str, str]] = []
        self.fail: dict[str, Exception] = {}
        self.uids = itertools.count(1)

    def _call(self, verb: str, name: str, group: str, version: str, plural: str, kwargs: dict) -> None:
        assert (group, version, plural) == ("resource.k8s.io", "v1", "resourceclaimtemplates")
        assert kwargs.get("_request_timeout"), f"{verb} {name} without a timeout"
        self.calls.append((verb, name))
        if verb in self.fail:
            raise self.fail[verb]

    def list_namespaced_custom_object(self, group, version, namespace, plural, label_selector=None, **kwargs):
        self._call("list", label_selector, group, version, plural, kwargs)
        assert namespace == "ns" and label_selector == "gpu-agent.io/domain-uid"
        return {"metadata": {"resourceVersion": "1"},
                "items": [copy.deepcopy(t) for t in self.templates.values()
                          if label_selector in (t["metadata"].get("labels") or {})]}

    def get_namespaced_custom_object(self, group, version, namespace, plural, name, **kwargs):
        self._call("get", name, group, version, plural, kwargs)
        if name not in self.templates:
            raise ApiException(status=404, reason="Not Found")
        return copy.deepcopy(self.templates[name])

    def create_namespaced_custom_object(self, group, version, namespace, plural, body, **kwargs):
        name = body["metadata"]["name"]
        self._call("create", name, group, version, plural, kwargs)
        assert namespace == body["metadata"]["namespace"] == "ns"
        if name in self.templates:
            raise ApiException(status=409, reason="AlreadyExists")
        self.templates[name] = read_back(body, uid=f"t-{next(self.uids)}")
        return copy.deepcopy(self.templates[name])

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name, body=None, **kwargs):
        self._call("delete", name, group, version, plural, kwargs)
        if name not in self.templates:
            raise ApiException(status=404, reason="Not Found")
        if body is not None and body.preconditions.uid != self.templates[name]["metadata"]["uid"]:
            raise ApiException(status=409, reason="Conflict")
        del self.templates[name]

    def mode_of(self, name: str) -> str:
        return self.templates[name]["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"]["allocationMode"]


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[dict, str, str, str, str]] = []

    def record(self, regarding, type_, reason, action, note):
        self.events.append((regarding, type_, reason, action, note))


def controller(api: FakeApi, clock: ManualClock | None = None, recorder: Recorder | None = None) -> ChannelTemplates:
    import random

    return ChannelTemplates(None, "ns", SETTINGS, clock=clock or ManualClock(), rng=random.Random(1),
                            recorder=recorder, custom_api=api)


def sync_due(ct: ChannelTemplates) -> list[str]:
    names = ct.take_due(ct.clock.monotonic())
    if names:
        ct.sync(names)
    return names


def test_the_controller_makes_keeps_remakes_and_cleans_up_the_template_with_one_list_per_pass():
    api = FakeApi()
    ct = controller(api)
    ct.domains_listed({"items": [gpudomain(channel())]})
    assert sync_due(ct) == ["d1"]
    assert api.calls == [("list", "gpu-agent.io/domain-uid"), ("get", "d1-channel"), ("create", "d1-channel")]
    assert api.mode_of("d1-channel") == "Single"

    api.calls.clear()
    ct.domain_event("MODIFIED", gpudomain(channel()))  # the aggregator's status write: the same generation
    assert sync_due(ct) == [] and api.calls == []
    ct.template_event("ADDED", api.templates["d1-channel"])  # our own create, seen by the watch: looked at, kept
    assert sync_due(ct) == ["d1"] and api.calls == [("list", "gpu-agent.io/domain-uid")]

    api.calls.clear()
    ct.domain_event("MODIFIED", gpudomain(channel(mode="All"), generation=2))
    assert sync_due(ct) == ["d1"]
    assert api.calls == [("list", "gpu-agent.io/domain-uid"), ("delete", "d1-channel"), ("create", "d1-channel")]
    assert api.mode_of("d1-channel") == "All"

    api.calls.clear()
    ct.domain_event("MODIFIED", gpudomain(channel("renamed"), generation=3))
    assert sync_due(ct) == ["d1"]
    assert api.calls == [("list", "gpu-agent.io/domain-uid"), ("get", "renamed"), ("delete", "d1-channel"),
                         ("create", "renamed")]
    assert set(api.templates) == {"renamed"}

    ct.domain_event("MODIFIED", gpudomain(generation=4))  # spec.channel removed
    assert sync_due(ct) == ["d1"] and api.templates == {}

    api.calls.clear()
    ct.domain_event("DELETED", gpudomain(generation=4))  # the garbage collector's part, not ours
    assert "d1" not in ct.domains and sync_due(ct) == [] and api.calls == []


def test_a_template_someone_deletes_is_made_again_on_its_watch_event():
    api = FakeApi()
    ct = controller(api)
    ct.domains_listed({"items": [gpudomain(channel())]})
    sync_due(ct)
    gone = api.templates.pop("d1-channel")
    ct.template_event("DELETED", gone)
    assert sync_due(ct) == ["d1"] and "d1-channel" in api.templates


def test_a_conflict_is_told_once_per_domain_with_a_warning_event_until_it_resolves(caplog):
    api = FakeApi(foreign())
    recorder = Recorder()
    ct = controller(api, recorder=recorder)
    domain = gpudomain(channel())
    ct.domains_listed({"items": [domain]})
    for _ in range(3):  # the first pass and two resyncs
        ct.domains_listed({"items": [domain]})
        sync_due(ct)
    assert "d1-channel" in api.templates and api.templates["d1-channel"]["metadata"]["uid"] == "t-foreign"
    assert ("create", "d1-channel") not in api.calls and not [c for c in api.calls if c[0] == "delete"]
    (event,) = recorder.events
    regarding, type_, reason, _, note = event
    assert (type_, reason) == ("Warning", "ChannelTemplateConflict")
    assert regarding == {"apiVersion": "gpu-agent.io/v1beta1", "kind": "GPUDomain", "name": "d1", "namespace": "ns",
                         "uid": UID}
    assert "ResourceClaimTemplate ns/d1-channel" in note and "Rename one of them" in note
    warnings = [r for r in caplog.records if "ChannelTemplate" in r.getMessage() or "Rename" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelname == "WARNING"

    del api.templates["d1-channel"]  # the other one renamed: ours is made at the next look
    ct.domains_listed({"items": [domain]})
    sync_due(ct)
    assert api.templates["d1-channel"]["metadata"]["ownerReferences"][0]["uid"] == UID
    api.templates["d1-channel"] = foreign()  # and should it come back, it is told again
    ct.domains_listed({"items": [domain]})
    sync_due(ct)
    assert len(recorder.events) == 2


def test_a_failed_call_retries_that_domain_with_backoff_and_a_status_write_does_not_cut_it_short():
    api = FakeApi()
    clock = ManualClock()
    ct = controller(api, clock)
    api.fail["create"] = ApiException(status=500, reason="Internal Server Error")
    ct.domains_listed({"items": [gpudomain(channel()), gpudomain(name="d2", uid=OTHER_UID)]})
    assert sync_due(ct) == ["d1", "d2"]
    assert ct.domains["d1"].due is not None and ct.domains["d2"].due is None  # d2 had nothing to do
    first_retry = ct.domains["d1"].due - clock.monotonic()
    assert 0.8 <= first_retry <= 1.0  # RETRY_INITIAL, shortened by at most a fifth
    ct.domain_event("MODIFIED", gpudomain(channel()))  # a status write
    assert sync_due(ct) == []
    clock.advance_blocking(first_retry)
    assert sync_due(ct) == ["d1"]  # failed again: the next wait doubles
    assert 1.6 <= ct.domains["d1"].due - clock.monotonic() <= 2.0
    del api.fail["create"]
    ct.domain_event("MODIFIED", gpudomain(channel(mode="All"), generation=2))  # a new spec does not wait
    assert sync_due(ct) == ["d1"] and api.mode_of("d1-channel") == "All"
    assert ct.domains["d1"].backoff is None and ct.domains["d1"].due is None

    api.fail["list"] = ApiException(status=503, reason="Service Unavailable")
    ct.domains_listed({"items": [gpudomain(channel(mode="All"), generation=2)]})
    assert sync_due(ct) == ["d1"] and ct.domains["d1"].due is not None  # nothing known: retried


def test_a_template_made_meanwhile_or_still_being_deleted_is_looked_at_again_without_a_warning(caplog):
    api = FakeApi()
    ct = controller(api)
    domain = gpudomain(channel())
    ct.domains_listed({"items": [domain]})
    api.fail["create"] = ApiException(status=409, reason="AlreadyExists")
    sync_due(ct)
    assert ct.domains["d1"].due is not None
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_every_due_domain_is_reconciled_at_the_resync_on_the_injected_clock_and_the_loop_ends_when_stopped():
    """No event tells the controller that a foreign template went (it is not ours to watch): the resync, every
    RESYNC seconds of the injected clock, makes ours then, and not before."""
    api = FakeApi(foreign())
    clock = ManualClock()
    ct = controller(api, clock)
    ct._watch_domains = lambda: ct.stop_event.wait()  # the domains are handed in below
    ct._watch_templates = lambda: ct.stop_event.wait()
    ct.domains_listed({"items": [gpudomain(channel())]})
    runner = threading.Thread(target=ct.run, daemon=True)
    runner.start()

    def settled():
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # poll to a deadline: the loop handled what was due and waits again
            if clock.blocked and not ct._wake.is_set():
                clock.step_thread(0.0)
                return
            time.sleep(0.001)
        raise AssertionError("the controller did not get back to waiting on its clock")

    try:
        settled()
        assert api.calls == [("list", "gpu-agent.io/domain-uid"), ("get", "d1-channel")]  # the conflict
        del api.templates["d1-channel"]
        clock.step_thread(ChannelTemplates.RESYNC - 1)
        settled()
        assert "d1-channel" not in api.templates
        clock.step_thread(1.0)
        settled()
        assert api.templates["d1-channel"]["metadata"]["ownerReferences"][0]["uid"] == UID
    finally:
        ct.stop()
        clock.advance_blocking(1.0)
        runner.join(2)
    assert not runner.is_alive()


def test_one_domains_controller_watches_only_that_domain(monkeypatch):
    from gpu_agent.mechanisms.domain import channels

    seen = {}
    monkeypatch.setattr(channels, "list_then_watch", lambda *args, **kwargs: seen.setdefault(args[4], kwargs))
    import random

    one = ChannelTemplates(None, "ns", SETTINGS, domain="d1", clock=ManualClock(), rng=random.Random(1), custom_api=FakeApi())
    one._watch_domains()
    one._watch_templates()
    assert seen["gpudomains"]["field_selector"] == "metadata.name=d1"
    assert seen["resourceclaimtemplates"]["label_selector"] == "gpu-agent.io/domain-uid"
    seen.clear()
    every = ChannelTemplates(None, "ns", SETTINGS, clock=ManualClock(), rng=random.Random(1), custom_api=FakeApi())
    every._watch_domains()
    assert "field_selector" not in seen["gpudomains"]


# -- the cluster agent runs it while it folds the domains ---------------------------------------------------------

@pytest.mark.parametrize("driver", ["gpu.gpu-agent.io", ""])
def test_the_cluster_agent_makes_channel_templates_only_while_folding_and_only_with_a_dra_driver(driver, tmp_path,
                                                                                                 monkeypatch):
    import argparse

    from gpu_agent.foundations.config import load
    from gpu_agent.mechanisms.domain import aggregate, channels
    from gpu_agent.roles import cluster_agent
    from tests.loopback_kubeconfig import loopback_kubeconfig

    monkeypatch.setattr(aggregate.EveryDomainAggregator, "run", lambda self: self._stop.wait())
    runs = []
    monkeypatch.setattr(channels.ChannelTemplates, "run", lambda self: (runs.append(self), self.stop_event.wait()))
    cfg = load(cluster_agent.SETTINGS, argparse.Namespace(), environ={
        "GPU_AGENT_KUBECONFIG": loopback_kubeconfig(9, tmp_path), "GPU_AGENT_GPU_SOURCE": "fake",
        "GPU_AGENT_FAKE_GPU_STATE_FILE": str(tmp_path / "gpus.json"), "GPU_AGENT_LISTEN_ADDRESS": "127.0.0.1:0",
        "GPU_AGENT_FOLD_ALL_DOMAINS": "true", "GPU_AGENT_DOMAIN_NAMESPACE": "ns", "GPU_AGENT_DRA_DRIVER_NAME": driver,
        "GPU_AGENT_CHANNEL_DEVICE_CLASS_NAME": "chan"}, as_=cluster_agent.ClusterAgentConfig)
    agent = cluster_agent.ClusterAgent(cfg, ManualClock())
    assert agent.channels is None  # nothing before it leads
    agent._start_folding()
    try:
        if not driver:
            assert agent.channels is None
            return
        ct = agent.channels
        assert ct is not None and (ct.namespace, ct.domain, ct.settings) == ("ns", "", ChannelSettings(driver, "chan"))
        assert ct.recorder is agent.recorder  # the conflicts' Events go where the folding's go
        deadline = time.monotonic() + 5
        while not runs and time.monotonic() < deadline:  # poll to a deadline: its thread starts
            time.sleep(0.001)
        assert runs == [ct] and "domain-channels" in agent.threads.running
    finally:
        agent._stop_folding()
    assert agent.channels is None and ct.stop_event.is_set()
    deadline = time.monotonic() + 5
    while "domain-channels" in agent.threads.running and time.monotonic() < deadline:
        time.sleep(0.001)
    assert "domain-channels" not in agent.threads.running and not agent.threads.died


# -- the CRD's side of the contract ------------------------------------------------------------------------------

def test_the_crd_declares_spec_channel_alike_in_both_versions_and_refuses_a_bad_template_name_naming_the_fix():
    import re
    from pathlib import Path

    import yaml

    crd = yaml.safe_load((Path(__file__).resolve().parents[3] / "charts/gpu-agent/crds/gpudomain.yaml").read_text())
    versions = crd["spec"]["versions"]
    assert [v["name"] for v in versions] == ["v1beta1", "v1alpha1"]
    assert versions[0]["schema"] == versions[1]["schema"], "conversion None: the versions' schemas must be the same"
    spec = versions[0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert "channel" not in spec.get("required", [])  # absent: no template
    ch = spec["properties"]["channel"]
    assert ch["type"] == "object" and ch["required"] == ["resourceClaimTemplate"]
    rct = ch["properties"]["resourceClaimTemplate"]
    assert rct["required"] == ["name"] and set(ch["properties"]) == {"resourceClaimTemplate", "allocationMode"}
    name = rct["properties"]["name"]
    assert (name["type"], name["maxLength"]) == ("string", 253)
    mode = ch["properties"]["allocationMode"]
    assert (mode["type"], mode["enum"], mode["default"]) == ("string", ["Single", "All"], "Single")
    for field in (ch, rct, name, mode):
        assert len(field["description"]) > 40, field  # what and why, as the chart's schemas describe

    (rule,) = name["x-kubernetes-validations"]
    assert rule["reason"] == "FieldValueInvalid"
    assert rule["message"].startswith("spec.channel.resourceClaimTemplate.name must be a DNS subdomain")
    assert "choose such a name" in rule["message"]
    pattern = re.fullmatch(r"self\.matches\('([^'\\]*)'\)", rule["rule"]).group(1)  # no escapes to read: RE2 = re
    for good in ("d1-channel", "a", "0", "a.b-c.d9", "x" * 253):
        assert re.search(pattern, good), good
    for bad in ("D1", "-a", "a-", "a..b", "a_b", ".a", "a.", "", "a/b", "a b"):
        assert not re.search(pattern, bad), bad
