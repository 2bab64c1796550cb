"""The node labels a fake-gpu pod keeps: what GPU feature discovery would set, written on change,
retried on failure, and removed (only from the nodes a release marked) by the post-delete hook."""

import json
from types import SimpleNamespace

from fake_gpu import node_labels
from fake_gpu.daemon import LayoutApplier
from fake_gpu.node_labels import COUNT, MEMORY, PRESENT, PRODUCT, RELEASE, NodeLabeler, desired, product_label
from fake_gpu.plugin import Devices
from fake_gpu.real_gpu_guard import DEFAULT_RESOURCE, owner_annotation


class FlakyPatch:
    """patch_node that fails the first `failures` calls and records the bodies of the rest."""

    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.calls = 0
        self.bodies = []

    def __call__(self, name, body):
        self.calls += 1
        if self.calls <= self.failures:
            raise ConnectionError("API server unreachable")
        self.bodies.append((name, body))


def test_the_labels_are_gpu_feature_discoverys_and_present_stays_true_at_zero_gpus():
    assert desired(8, "NVIDIA H100 80GB HBM3", 81559, "fg") == {
        PRESENT: "true", COUNT: "8", PRODUCT: "NVIDIA-H100-80GB-HBM3", MEMORY: "81559", RELEASE: "fg"}
    assert desired(0, "NVIDIA H100 80GB HBM3", 81559, "fg")[PRESENT] == "true"


def test_a_product_name_becomes_a_valid_label_value():
    assert product_label("NVIDIA A100-SXM4-40GB") == "NVIDIA-A100-SXM4-40GB"
    assert product_label("GPU (fake) / #1") == "GPU--fake-----1"
    assert product_label(" " * 3 + "x" * 100) == "x" * 63
    assert product_label("--") == "unknown"


def test_labels_are_written_once_per_change_and_a_failed_write_is_retried_with_growing_waits():
    patch = FlakyPatch(failures=2)
    labeler = NodeLabeler("n1", patch)
    assert labeler.sync() and patch.calls == 0  # nothing wanted yet

    labeler.set(desired(4, "p", 1, "fg"))
    assert not labeler.sync() and labeler.retry_after() == 1.0
    assert not labeler.sync() and labeler.retry_after() == 2.0
    assert labeler.sync() and labeler.retry_after() == 0.0
    assert patch.bodies == [("n1", {"metadata": {"labels": desired(4, "p", 1, "fg")}})]

    assert labeler.sync() and patch.calls == 3  # unchanged: no write
    labeler.set(desired(2, "p", 1, "fg"))
    assert labeler.sync() and patch.bodies[-1][1]["metadata"]["labels"][COUNT] == "2" and patch.calls == 4


def test_retry_waits_are_capped():
    labeler = NodeLabeler("n1", FlakyPatch(failures=100))
    labeler.set(desired(1, "p", 1, "fg"))
    for _ in range(20):
        labeler.sync()
    assert labeler.retry_after() == NodeLabeler.RETRY_SECONDS[-1]


def test_the_applier_labels_the_node_with_each_layout_it_applies_and_not_with_one_it_refuses(tmp_path):
    patch = FlakyPatch()
    labeler = NodeLabeler("n1", patch)
    applier = LayoutApplier("n1", tmp_path / "state.json", Devices(), default_count=0, labeler=labeler, release="fg")
    applier.apply({"n1": json.dumps({"count": 3, "product": "NVIDIA H200", "memoryMiB": 143771})})
    labeler.sync()
    assert patch.bodies[-1][1]["metadata"]["labels"] == {
        PRESENT: "true", COUNT: "3", PRODUCT: "NVIDIA-H200", MEMORY: "143771", RELEASE: "fg"}
    applier.apply({"n1": json.dumps({"count": -1})})  # refused: the node keeps its GPUs and its labels
    assert labeler.sync() and len(patch.bodies) == 1
    applier.apply(None)  # no layout: the default count (0) on a GPU node that is still one
    labeler.sync()
    assert patch.bodies[-1][1]["metadata"]["labels"][COUNT] == "0"
    assert patch.bodies[-1][1]["metadata"]["labels"][PRESENT] == "true"


def test_unlabel_removes_every_label_of_the_release_from_exactly_the_nodes_it_marked():
    class Core:
        def __init__(self):
            self.selectors, self.patched = [], []

        def list_node(self, label_selector, _request_timeout):
            self.selectors.append(label_selector)
            return SimpleNamespace(items=[SimpleNamespace(metadata=SimpleNamespace(name=n)) for n in ("a", "c")])

        def patch_node(self, name, body, _request_timeout):
            self.patched.append((name, body))

    core = Core()
    assert node_labels.unlabel_nodes(core, "fg") == ["a", "c"]
    assert core.selectors == [f"{RELEASE}=fg"]
    removal = {"metadata": {"labels": {PRESENT: None, COUNT: None, PRODUCT: None, MEMORY: None, RELEASE: None},
                            "annotations": {owner_annotation(DEFAULT_RESOURCE): None}}}
    assert core.patched == [("a", removal), ("c", removal)]
