"""GPU workloads on the fake GPUs: the DRA bats suite's "GPU basic", "stress" and "robustness"
groups, with device-plugin GPUs (exclusive, no shared claims) in place of DRA claims."""

from __future__ import annotations

import os
import time

import pytest

from e2e.helpers import apply, pod_log, wait_until


def uuid_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "UUID: GPU-" in line]


def uuid_of(line: str) -> str:
    return line.split("UUID: ")[1].rstrip(")")


def ready(core, ns, pod) -> bool:
    p = core.read_namespaced_pod(pod, ns)
    return any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])


@pytest.mark.fast
def test_one_pod_one_gpu_is_ready_within_8s_with_exactly_one_uuid_line(fake_gpus, api, core, namespace):
    fake_gpus.set(2)
    started = time.monotonic()
    apply(api, namespace, "gpu-pod.yaml.j2", name="one", gpus=1, sleep=60)
    wait_until(lambda: ready(core, namespace, "one"), 8, "the pod Ready within 8 s", interval=0.1)
    took = time.monotonic() - started
    lines = wait_until(lambda: uuid_lines(pod_log(core, namespace, "one")), 10, "the UUID line")
    print(f"\ncreate -> Ready: {took:.1f}s")
    assert len(lines) == 1


@pytest.mark.fast
def test_a_pod_with_two_containers_each_asking_one_gpu_gets_two_different_ones(fake_gpus, api, core, namespace):
    fake_gpus.set(2)
    apply(api, namespace, "gpu-pod-two-containers.yaml.j2", name="pair")
    first = wait_until(lambda: uuid_lines(pod_log(core, namespace, "pair", "first")), 30, "first container's UUID")
    second = wait_until(lambda: uuid_lines(pod_log(core, namespace, "pair", "second")), 30, "second container's UUID")
    assert len(first) == 1 and len(second) == 1
    assert uuid_of(first[0]) != uuid_of(second[0])


def test_advertised_count_and_attributes_match_the_layout(fake_gpus, api, core, namespace):
    r = fake_gpus.command("set", "--node", fake_gpus.node, "--count", "3", "--product", "NVIDIA A100-SXM4-40GB",
                          "--memory-mib", "40960")
    assert r.returncode == 0, r.stderr
    wait_until(lambda: fake_gpus.allocatable() == 3, 10, "allocatable 3")
    node = core.read_node(fake_gpus.node)
    assert node.status.capacity["nvidia.com/gpu"] == "3"
    apply(api, namespace, "gpu-pod.yaml.j2", name="all", gpus=3, sleep=60)
    lines = wait_until(lambda: (lambda lines: len(lines) == 3 and lines)(uuid_lines(pod_log(core, namespace, "all"))),
                       30, "three UUID lines")
    assert all("NVIDIA A100-SXM4-40GB" in line for line in lines), lines
    fake_gpus.set(0)


def stress_shape() -> tuple[int, int]:
    pods, _, loops = os.environ.get("E2E_STRESS", "15x5").partition("x")
    return int(pods), int(loops)


def test_stress_pods_times_loops_leave_nothing_behind(fake_gpus, api, core, namespace):
    """Each loop: create N one-GPU pods, wait all Ready, check every UUID line (one each, all
    different), delete, and wait until no pod, no warning event and no allocated device is left."""
    pods, loops = stress_shape()
    fake_gpus.set(pods)
    times = []
    for loop in range(loops):
        started = time.monotonic()
        prefix = f"s{loop}"
        apply(api, namespace, "gpu-pods.yaml.j2", prefix=prefix, count=pods)
        names = [f"{prefix}-{i}" for i in range(pods)]
        wait_until(lambda names=names: all(ready(core, namespace, n) for n in names), 180, f"loop {loop}: {pods} pods Ready", interval=0.5)
        uuids = []
        for n in names:
            lines = wait_until(lambda n=n: uuid_lines(pod_log(core, namespace, n)), 30, f"{n}'s UUID line")
            assert len(lines) == 1, (n, lines)
            uuids.append(uuid_of(lines[0]))
        assert len(set(uuids)) == pods, f"loop {loop}: a GPU was given to two pods: {sorted(uuids)}"
        core.delete_collection_namespaced_pod(namespace, label_selector=f"stress={prefix}")
        wait_until(lambda prefix=prefix: not core.list_namespaced_pod(namespace, label_selector=f"stress={prefix}").items, 90,
                   f"loop {loop}: pods gone", interval=0.5)
        times.append(time.monotonic() - started)
    warnings = [e for e in core.list_namespaced_event(namespace).items if e.type == "Warning"]
    print(f"\nstress {pods} x {loops}: loops took {[round(t, 1) for t in times]} s")
    assert not warnings, [(e.reason, e.message) for e in warnings]
    # No device stays allocated: a pod asking for every GPU fits at once.
    apply(api, namespace, "gpu-pod.yaml.j2", name="everything", gpus=pods, sleep=5)
    wait_until(lambda: len(uuid_lines(pod_log(core, namespace, "everything"))) == pods, 60, "a pod with every GPU")


def test_ten_rapid_create_delete_cycles_leak_nothing(fake_gpus, api, core, namespace):
    fake_gpus.set(2)
    for k in range(10):
        apply(api, namespace, "gpu-pod.yaml.j2", name=f"rapid-{k}", gpus=2, sleep=600)
        wait_until(lambda k=k: core.read_namespaced_pod(f"rapid-{k}", namespace).status.phase == "Running", 60,
                   f"rapid-{k} running", interval=0.1)
        core.delete_namespaced_pod(f"rapid-{k}", namespace, grace_period_seconds=0)
    wait_until(lambda: not core.list_namespaced_pod(namespace).items, 60, "every pod gone")
    apply(api, namespace, "gpu-pod.yaml.j2", name="after", gpus=2, sleep=5)
    lines = wait_until(lambda: (lambda lines: len(lines) == 2 and lines)(uuid_lines(pod_log(core, namespace, "after"))),
                       60, "both GPUs free for the next pod")
    assert len({uuid_of(x) for x in lines}) == 2
    assert fake_gpus.allocatable() == 2
