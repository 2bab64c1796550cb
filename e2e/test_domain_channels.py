"""GPUDomain channels, the ComputeDomain way, on the real kubelets, scheduler, resourceclaim controller and a
containerd with CDI: the chart with `dra.enabled` (its default `dra.domainChannels` on).

Mirrors the DRA driver's IMEX channel rows (`test_cd_imex_chan_inject.bats`: `ls -la /dev/nvidia-caps-imex-channels`
in the workload shows `channel0`, or with allocationMode All `channel2047` and `channel222`) and what a ComputeDomain
user sees meanwhile: a Pod referencing the domain's channel template waits in ContainerCreating with a
FailedPrepareDynamicResources event while its node is not a Ready member, and starts once it is. Evidence is the
cluster's: the template is the API server's object, the events the kubelet's, the domain's readiness the folded
status the cluster agent writes, and what the workload got is what it prints itself.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import time
import uuid

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.artifacts import dump, failing_test
from e2e.helpers import IMAGE, Sampler, apply, pod_log, wait_until
from e2e.release import Release

pytestmark = pytest.mark.lane("dra", nodes=2, reason="one DRA driver per node: its registration socket in each kubelet's "
                                                     "plugin registry belongs to this module's release alone (test_dra.py's, "
                                                     "at another time)")

DRIVER = "gpu.gpu-agent.io"
CHANNEL_CLASS = "channel.gpu-agent.io"
GROUP, VERSION, PLURAL = "gpu-agent.io", "v1beta1", "gpudomains"


@pytest.fixture(scope="module")
def channels(api, core, apps, kubeconfig, fake_gpus):
    """One DRA release for the module; its namespace is the domains', so the workloads run there (a domain's channel
    serves only claims of its own namespace). Each test makes its own domain and pods, and deletes its pods."""
    ns = f"e2e-channels-{uuid.uuid4().hex[:5]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns, labels={"e2e": "true"})))
    release = Release(api, core, apps, kubeconfig, ns, name="ch")
    fake_gpus.set(2)
    release.install("--set", "dra.enabled=true", "--set", "gracefulNoGPU=true", "--wait")
    yield release
    release.uninstall_if_installed()
    client.ResourceV1Api(api).delete_collection_resource_slice(field_selector=f"spec.driver={DRIVER}")
    core.delete_namespace(ns)


def make_domain(api, ns, name, template, mode="Single", expected=1):
    return client.CustomObjectsApi(api).create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "GPUDomain", "metadata": {"name": name},
        "spec": {"expectedNodes": expected, "channel": {"resourceClaimTemplate": {"name": template}, "allocationMode": mode}}})


def delete_domain(api, ns, name):
    try:
        client.CustomObjectsApi(api).delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
    except ApiException as e:
        if e.status != 404:
            raise


def domain_node_status(api, ns, name, node):
    obj = client.CustomObjectsApi(api).get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
    return next((n.get("status") for n in (obj.get("status") or {}).get("nodes") or [] if n.get("name") == node), None)


def template(api, ns, name):
    try:
        return json.loads(client.ResourceV1Api(api).read_namespaced_resource_claim_template(
            name, ns, _preload_content=False).data)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


WORKLOAD = ("ls -la /dev/nvidia-caps-imex-channels | grep -c ' channel' | sed 's/^/channels: /'; "
            "ls -la /dev/nvidia-caps-imex-channels | grep -E ' channel(0|222|2047)$'; "
            "env | grep ^GPU_AGENT_DOMAIN | sort; echo '-- peers'; cat /etc/gpu-agent/domain/peers; echo '-- end'; "
            "sleep 600")


def workload_pod(name, node, claims):
    """A Pod on `node` whose claims are [(pod claim name, {"resourceClaimTemplateName"|"resourceClaimName": ...})]."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "nodeSelector": {"kubernetes.io/hostname": node},
                     "resourceClaims": [{"name": n, **source} for n, source in claims],
                     "containers": [{"name": "work", "image": IMAGE, "imagePullPolicy": "Never",
                                     "command": ["sh", "-c", WORKLOAD],
                                     "resources": {"claims": [{"name": n} for n, _ in claims]}}]}}


def delete_pod_and_wait(core, ns, name, timeout=60):
    try:
        core.delete_namespaced_pod(name, ns, grace_period_seconds=0)
    except ApiException as e:
        if e.status != 404:
            raise

    def gone():
        try:
            core.read_namespaced_pod(name, ns)
        except ApiException as e:
            return e.status == 404
        return False
    wait_until(gone, timeout, f"pod {ns}/{name} gone (its claim unprepared and deallocated)")
    claims_gone(core.api_client, ns, {name}, timeout)


def claims_gone(api, ns, pods, timeout=60):
    """The claims Kubernetes made for `pods` (from templates, owned by the pod) deleted: until then the node's
    channel-0 is still allocated, and the next test's pod there waits for the scheduler's next try (seen: 70 s)."""
    def none_left():
        listed = json.loads(client.ResourceV1Api(api).list_namespaced_resource_claim(ns, _preload_content=False).data)
        return not [c for c in listed["items"] for o in c["metadata"].get("ownerReferences") or []
                    if o.get("kind") == "Pod" and o.get("name") in pods]
    wait_until(none_left, timeout, f"the claims of {sorted(pods)} deleted")


def failed_prepare(core, ns, pod):
    return [e.message for e in core.list_namespaced_event(ns, field_selector=f"involvedObject.name={pod}").items
            if e.reason == "FailedPrepareDynamicResources"]


def output(core, ns, pod):
    text = pod_log(core, ns, pod)
    return text if "-- end" in text else None


def dump_if_failing(core, ns):
    """The module's release namespace is no test's own, which the suite dumps: a failing test dumps it here, before its
    pods go."""
    if sys.exc_info()[0] is not None and failing_test():
        print(f"\nthe release namespace is in {dump(core, ns, failing_test(), into='release')}")


def scale_cluster_agent(release, replicas):
    release.apps.patch_namespaced_deployment_scale(f"{release.fullname}-cluster-agent", release.namespace,
                                                   {"spec": {"replicas": replicas}})


def test_channel_injection_single_waits_for_the_node_to_be_ready_in_the_domain_then_sees_exactly_channel0(
        channels, api, core, fake_gpus):
    release, ns, node = channels, channels.namespace, fake_gpus.node
    make_domain(api, ns, "single", "single-channel")
    made = wait_until(lambda: template(api, ns, "single-channel"), 30, "the cluster agent's channel template")
    (request,) = made["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == CHANNEL_CLASS
    assert made["metadata"]["ownerReferences"][0]["kind"] == "GPUDomain"
    # Nobody folds the domain while no cluster agent runs: the node's member is written, never shown Ready.
    scale_cluster_agent(release, 0)
    wait_until(lambda: not release.pods("app.kubernetes.io/component=cluster-agent"), 60, "no cluster agent pod")
    core.create_namespaced_pod(ns, workload_pod("single", node, [("channel", {"resourceClaimTemplateName": "single-channel"})]))
    try:
        messages = wait_until(lambda: failed_prepare(core, ns, "single"), 90,
                              "a FailedPrepareDynamicResources event while the node is not Ready in the domain")
        print(f"\nthe waiting pod's event: {messages[0]}")
        assert f"node {node} not Ready in GPUDomain {ns}/single" in messages[0]
        assert "permanent" not in messages[0]
        status = core.read_namespaced_pod("single", ns).status
        assert status.phase == "Pending"
        assert status.container_statuses[0].state.waiting.reason == "ContainerCreating"

        scale_cluster_agent(release, 1)
        wait_until(lambda: domain_node_status(api, ns, "single", node) == "Ready", 120, f"{node} Ready in the domain",
                   interval=0.1)
        ready = time.monotonic()
        wait_until(lambda: core.read_namespaced_pod("single", ns).status.phase == "Running", 60, "the pod Running",
                   interval=0.1)
        took = time.monotonic() - ready
        print(f"the pod Running {took:.1f}s after the domain's status showed {node} Ready")
        # The kubelet's own retry of a failed prepare is its next resync of the pod, 60-90 s later (measured: no
        # retry in 62 s); the node agent's nudge (an annotation on the pod) brings it at once.
        assert took <= 2.0
        text = wait_until(lambda: output(core, ns, "single"), 30, "the workload's output")
        print(text)
        assert "channels: 1" in text
        assert text.count(" channel0\n") == 1 and " channel222" not in text
        assert f"GPU_AGENT_DOMAIN={ns}/single" in text and "GPU_AGENT_DOMAIN_NODE_INDEX=0" in text
        peers = text.split("-- peers\n")[1].split("-- end")[0]
        assert f"0 {node} " in peers and "Ready" in peers
    finally:
        dump_if_failing(core, ns)
        scale_cluster_agent(release, 1)
        delete_pod_and_wait(core, ns, "single")
        delete_domain(api, ns, "single")


def test_channel_injection_all_gives_every_channel_of_the_range(channels, api, core, fake_gpus):
    ns, node = channels.namespace, fake_gpus.node
    make_domain(api, ns, "all", "all-channels", mode="All")
    wait_until(lambda: template(api, ns, "all-channels"), 30, "the cluster agent's channel template")
    core.create_namespaced_pod(ns, workload_pod("all", node, [("channel", {"resourceClaimTemplateName": "all-channels"})]))
    try:
        text = wait_until(lambda: output(core, ns, "all"), 120, "the workload's output")
        print("\n" + text)
        assert "channels: 2048" in text
        for n in (0, 222, 2047):
            assert f" channel{n}\n" in text, n
    finally:
        delete_pod_and_wait(core, ns, "all")
        delete_domain(api, ns, "all")


def test_a_channel_claim_from_another_namespace_is_refused_for_good(channels, api, core, namespace, fake_gpus):
    ns, node = channels.namespace, fake_gpus.node
    make_domain(api, ns, "theirs", "theirs-channel")
    made = wait_until(lambda: template(api, ns, "theirs-channel"), 30, "the cluster agent's channel template")
    # the template's claim spec, copied by hand into another namespace
    client.ResourceV1Api(api).create_namespaced_resource_claim(namespace, {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "borrowed"},
        "spec": made["spec"]["spec"]})
    core.create_namespaced_pod(namespace, workload_pod("borrower", node, [("channel", {"resourceClaimName": "borrowed"})]))
    try:
        messages = wait_until(lambda: failed_prepare(core, namespace, "borrower"), 30, "a FailedPrepareDynamicResources event")
        print(f"\n{messages[0]}")
        assert "permanent error" in messages[0] and "serves only claims of its own namespace" in messages[0]
        assert core.read_namespaced_pod("borrower", namespace).status.phase == "Pending"
    finally:
        delete_pod_and_wait(core, namespace, "borrower")
        # a claim of its own (no template's): allocated, it holds the node's channel-0 until it is deleted
        client.ResourceV1Api(api).delete_namespaced_resource_claim("borrowed", namespace)
        wait_until(lambda: not json.loads(client.ResourceV1Api(api).list_namespaced_resource_claim(
            namespace, _preload_content=False).data)["items"], 60, "the borrowed claim deleted")
        delete_domain(api, ns, "theirs")


def test_a_deleted_domain_takes_its_channel_template_with_it(channels, api, core):
    ns = channels.namespace
    make_domain(api, ns, "brief", "brief-channel")
    wait_until(lambda: template(api, ns, "brief-channel"), 30, "the cluster agent's channel template")
    delete_domain(api, ns, "brief")
    started = time.monotonic()
    wait_until(lambda: template(api, ns, "brief-channel") is None, 60, "the template gone with its domain")
    print(f"\nthe template went {time.monotonic() - started:.1f}s after its domain")


def second_gpu_node(core, fake_gpus):
    return next(n for n in fake_gpus.nodes if n != fake_gpus.node)


def job_pods(core, ns, job):
    return sorted(core.list_namespaced_pod(ns, label_selector=f"job-name={job}").items,
                  key=lambda p: int(p.metadata.annotations.get("batch.kubernetes.io/job-completion-index", "0")))


def run_workload(api, core, ns, name, timeout=240, **values):
    """The indexed Job of e2e/manifests/domain-workload.yaml.j2 run to completion; each index's log, by index."""
    apply(api, ns, "domain-workload.yaml.j2", name=name, pull_policy="Never", **values)
    batch = client.BatchV1Api(api)

    def done():
        status = batch.read_namespaced_job_status(name, ns).status
        if status.failed:
            raise AssertionError(f"job {name} failed: {[pod_log(core, ns, p.metadata.name) for p in job_pods(core, ns, name)]}")
        return (status.succeeded or 0) == values["n"]
    started = time.monotonic()
    wait_until(done, timeout, f"job {name}: {values['n']} indexes succeeded", interval=0.5)
    took = time.monotonic() - started
    print(f"\njob {name} complete in {took:.1f}s")
    if took > SLOW_JOB:  # a job that usually takes seconds: what it waited on, for the next look (issue 47)
        print_timeline(core, ns, int(took) + 30)
    return [pod_log(core, ns, p.metadata.name) for p in job_pods(core, ns, name) if p.status.phase == "Succeeded"]


SLOW_JOB = 30.0


def print_timeline(core, ns, seconds):
    """Where a slow job's time went: the namespace's events of the last `seconds` in time order (scheduling, the
    kubelet's claim prepare, starts), then the node agents' lines of the same time about claims and domains (when the
    kubelet called NodePrepareResources, how long a channel's prepare waited for its node to be Ready)."""
    def when(e):
        return e.event_time or e.last_timestamp or e.first_timestamp or e.metadata.creation_timestamp
    since = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=seconds)
    events = sorted((e for e in core.list_namespaced_event(ns, _request_timeout=10).items if when(e) >= since), key=when)
    for e in events:
        count = f" x{e.count}" if (e.count or 1) > 1 else ""
        print(f"  {when(e):%H:%M:%S} {e.involved_object.kind}/{e.involved_object.name} {e.reason}{count}: {e.message or ''}")
    for pod in core.list_namespaced_pod(ns, label_selector="app.kubernetes.io/component=node-agent", _request_timeout=10).items:
        try:
            text = core.read_namespaced_pod_log(pod.metadata.name, ns, since_seconds=seconds, _request_timeout=10)
        except ApiException as e:
            print(f"  node agent {pod.metadata.name}: its log unread ({e.status} {e.reason})")
            continue
        for line in text.splitlines():
            if "claim" in line or "GPUDomain" in line:
                print(f"  [{pod.spec.node_name}] {line}")


def delete_job(api, core, ns, name):
    pods = {p.metadata.name for p in job_pods(core, ns, name)}
    try:
        client.BatchV1Api(api).delete_namespaced_job(name, ns, propagation_policy="Background", grace_period_seconds=0)
    except ApiException as e:
        if e.status != 404:
            raise
    wait_until(lambda: not job_pods(core, ns, name), 60, f"job {name}'s pods gone")
    claims_gone(api, ns, pods)


def test_nickelpie_analog_two_pods_on_two_nodes_of_one_domain_see_each_other_and_complete(channels, api, core, fake_gpus):
    """nickelpie's shape over TCP (fake GPUs, no NVLink fabric): send/recv around the ring and a broadcast, each rank
    finding the other through the domain's peer list mounted by its channel claim."""
    ns, first = channels.namespace, fake_gpus.node
    second = second_gpu_node(core, fake_gpus)
    fake_gpus.set(1, node=second)  # a member is Ready only with a healthy GPU
    make_domain(api, ns, "pair", "pair-channel", expected=2)
    wait_until(lambda: template(api, ns, "pair-channel"), 30, "the cluster agent's channel template")
    try:
        logs = run_workload(api, core, ns, "nickelpie", n=2, pattern="nickelpie", claim_template="pair-channel",
                            nodes=[first, second], timeout=180)
        for text in logs:
            print(text)
        assert len(logs) == 2
        for rank, text in enumerate(logs):
            assert "PASSED" in text.splitlines()[-1], text
            other = second if rank == 0 else first
            assert other in text, f"rank {rank} never saw {other} in its peer list"
    finally:
        dump_if_failing(core, ns)
        delete_job(api, core, ns, "nickelpie")
        delete_domain(api, ns, "pair")
        fake_gpus.set(0, node=second)


def test_nvbandwidth_analog_2_nodes_x_2_gpus_prints_a_complete_all_pairs_table(channels, api, core, fake_gpus):
    ns, first = channels.namespace, fake_gpus.node
    second = second_gpu_node(core, fake_gpus)
    fake_gpus.set(2)
    fake_gpus.set(2, node=second)
    make_domain(api, ns, "quad", "quad-channel", expected=2)
    client.ResourceV1Api(api).create_namespaced_resource_claim_template(ns, {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "two-gpus"},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
            "deviceClassName": "gpu.gpu-agent.io", "allocationMode": "ExactCount", "count": 2}}]}}}})
    wait_until(lambda: template(api, ns, "quad-channel"), 30, "the cluster agent's channel template")
    try:
        logs = run_workload(api, core, ns, "nvbandwidth", n=2, pattern="nvbandwidth", claim_template="quad-channel",
                            gpu_claim_template="two-gpus", nodes=[first, second], timeout=180)
        assert all("PASSED" in text.splitlines()[-1] for text in logs), logs
        # rank 0 (the domain's index 0, whichever Job index it runs at) gathers and prints the table
        table = next((text for text in logs if "bandwidth (GB/s)" in text), "")
        print(table)
        lines = [line.split("] ", 1)[-1] for line in table.splitlines()]  # without the "[rank 0/2] " prefix
        header = next(i for i, line in enumerate(lines) if "bandwidth (GB/s)" in line)
        columns = lines[header + 1].split()
        rows = {line.split()[0]: line.split()[1:] for line in lines[header + 2:] if line[:1].isdigit()}
        assert columns == list(rows) == ["0:0", "0:1", "1:0", "1:1"]  # node:gpu pairs, 2 x 2
        for row, cells in rows.items():  # complete: a figure in every cell but the diagonal
            assert [c for c, value in zip(columns, cells, strict=True) if value == "N/A"] == [row]
            assert all(float(v) > 0 for v in cells if v != "N/A")
    finally:
        dump_if_failing(core, ns)
        delete_job(api, core, ns, "nvbandwidth")
        client.ResourceV1Api(api).delete_namespaced_resource_claim_template("two-gpus", ns)
        delete_domain(api, ns, "quad")
        fake_gpus.set(0, node=second)


def domain_ready(api, ns, name):
    obj = client.CustomObjectsApi(api).get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in (obj.get("status") or {}).get("conditions") or [])


def index_pod(core, ns, job, index):
    """The Job's Pod of `index` that is not being deleted, or None."""
    return next((p for p in job_pods(core, ns, job) if p.metadata.deletion_timestamp is None and
                 p.metadata.annotations.get("batch.kubernetes.io/job-completion-index") == str(index)), None)


FAILOVERS = {
    # the seed's `CD failover nvb2: ...` rows, as the seed runs them, under a running 2-node workload
    "force-delete worker pod 0": "worker-0",
    "force-delete all IMEX daemons (our node agents)": "agents",
    "regular-delete worker pod 1": "worker-1",
}


@pytest.mark.parametrize("row", FAILOVERS)
def test_failover_a_running_two_node_workload_completes_through(row, channels, api, core, fake_gpus):
    release, ns, first = channels, channels.namespace, fake_gpus.node
    second = second_gpu_node(core, fake_gpus)
    fake_gpus.set(1, node=second)
    what, name = FAILOVERS[row], f"fo-{FAILOVERS[row]}"
    make_domain(api, ns, name, f"{name}-channel", expected=2)
    wait_until(lambda: template(api, ns, f"{name}-channel"), 30, "the cluster agent's channel template")
    batch = client.BatchV1Api(api)
    try:
        # 60 repeats half a second apart: about 30 s of work, disrupted in its middle
        apply(api, ns, "domain-workload.yaml.j2", name=name, n=2, pattern="nickelpie", claim_template=f"{name}-channel",
              nodes=[first, second], timeout=300, pull_policy="Never", args=["--repeat", "60", "--interval", "0.5"])
        wait_until(lambda: all("(repeat 3/60)" in pod_log(core, ns, p.metadata.name) for p in job_pods(core, ns, name))
                   and len(job_pods(core, ns, name)) == 2, 120, "both ranks in the middle of the run", interval=0.5)
        with Sampler(lambda: domain_ready(api, ns, name), 0.1) as readiness:  # the sampler records, the test judges
            started = time.monotonic()
            if what == "agents":
                for pod in release.pods("app.kubernetes.io/component=node-agent"):
                    core.delete_namespaced_pod(pod.metadata.name, ns, grace_period_seconds=0)
            else:
                index = int(what[-1])
                victim = index_pod(core, ns, name, index)
                core.delete_namespaced_pod(victim.metadata.name, ns, grace_period_seconds=0 if index == 0 else None)
                wait_until(lambda: (p := index_pod(core, ns, name, index)) is not None and
                           p.metadata.uid != victim.metadata.uid and p.status.phase == "Running", 180,
                           f"a replacement of worker pod {index} Running", interval=0.25)
                print(f"\n{row}: the replacement Running {time.monotonic() - started:.1f}s after the delete")
            wait_until(lambda: (batch.read_namespaced_job_status(name, ns).status.succeeded or 0) == 2, 300,
                       "the workload complete", interval=0.5)
            print(f"{row}: the workload complete {time.monotonic() - started:.1f}s after the disruption")
        after = [(t - started, ready) for t, ready in readiness.samples if t >= started]
        lost = [t for t, ready in after if ready is not True]
        if what != "agents":  # a worker's node leaves the domain with its claim, and joins again with the new one's
            assert lost, f"the domain never went NotReady: {len(after)} samples"
        if lost:
            back = next((t for t, ready in after if t > lost[0] and ready is True), None)
            assert back is not None, f"the domain not Ready again after {lost[0]:.1f}s: {after[-5:]}"
            print(f"{row}: the domain NotReady {lost[0]:.1f}s after the disruption, Ready again at {back:.1f}s "
                  f"({len(after)} samples, every 0.1 s)")
        else:
            print(f"{row}: the domain stayed Ready throughout ({len(after)} samples, every 0.1 s)")
        for pod in job_pods(core, ns, name):
            if pod.status.phase == "Succeeded":
                assert "PASSED nickelpie: 2 ranks" in pod_log(core, ns, pod.metadata.name).splitlines()[-1]
        if what == "agents":
            assert len(job_pods(core, ns, name)) == 2  # the workload's pods ran on, none replaced
    finally:
        dump_if_failing(core, ns)
        delete_job(api, core, ns, name)
        delete_domain(api, ns, name)
        fake_gpus.set(0, node=second)


PEER_WATCHER = ("python3 -u -c \"import time\nwhile True:\n    try:\n        lines = open('/etc/gpu-agent/domain/peers')"
                ".read().splitlines()[1:]\n    except OSError:\n        lines = []\n"
                "    print('T=%.3f %s' % (time.time(), ','.join(sorted(l.split()[1] for l in lines if l.endswith("
                "' Ready')))), flush=True)\n    time.sleep(0.1)\"")


def seen_after(core, ns, pod, since, nodes):
    """The wall time (the container's; the CI cluster's nodes share this host's clock) of the first line the watcher
    printed after `since` whose Ready peers are exactly `nodes`; None before."""
    for line in pod_log(core, ns, pod).splitlines():
        if line.startswith("T="):
            stamp, _, names = line[2:].partition(" ")
            if float(stamp) > since and names == ",".join(sorted(nodes)):
                return float(stamp)
    return None


def test_the_peer_list_in_a_running_workload_follows_a_member_leaving_and_coming_back(channels, api, core, fake_gpus):
    """The peer list is a mount of a folder the node agent rewrites: a running container sees a member leave (its
    node's last channel claim unprepared) and come back (a new claim prepared there) without restarting."""
    ns, first = channels.namespace, fake_gpus.node
    second = second_gpu_node(core, fake_gpus)
    fake_gpus.set(1, node=second)
    make_domain(api, ns, "watched", "watched-channel", expected=2)
    wait_until(lambda: template(api, ns, "watched-channel"), 30, "the cluster agent's channel template")
    claim = [("channel", {"resourceClaimTemplateName": "watched-channel"})]
    watcher = workload_pod("watcher", first, claim)
    watcher["spec"]["containers"][0]["command"] = ["sh", "-c", PEER_WATCHER]
    other = workload_pod("other", second, claim)
    try:
        core.create_namespaced_pod(ns, watcher)
        core.create_namespaced_pod(ns, other)
        wait_until(lambda: seen_after(core, ns, "watcher", 0, [first, second]), 120, "the watcher seeing both nodes")
        left = time.time()
        delete_pod_and_wait(core, ns, "other")
        gone = wait_until(lambda: seen_after(core, ns, "watcher", left, [first]), 30, f"{second} gone from the list")
        back_at = time.time()
        core.create_namespaced_pod(ns, other)
        back = wait_until(lambda: seen_after(core, ns, "watcher", back_at, [first, second]), 60, f"{second} back")
        print(f"\n{second} left (its pod deleted): gone from a running workload's peer list {gone - left:.1f}s later; "
              f"its new pod created: back in the list {back - back_at:.1f}s later")
        ttl = 3 * 5.0  # domain.heartbeatTTL x the heartbeat interval: the bound a dead member is NotReady within
        assert gone - left <= ttl + 1 and back - back_at <= ttl + 1
        assert core.read_namespaced_pod("watcher", ns).status.container_statuses[0].restart_count == 0
    finally:
        dump_if_failing(core, ns)
        for pod in ("watcher", "other"):
            delete_pod_and_wait(core, ns, pod)
        delete_domain(api, ns, "watched")
        fake_gpus.set(0, node=second)
