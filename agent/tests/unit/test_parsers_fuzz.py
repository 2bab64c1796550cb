"""Property-based fuzzing (hypothesis) of every file the agent and fake-gpu read.

The property is the same for each: any input either parses or raises the parser's own error
with a message, never anything else; and through the GPU source, an input that does not parse
always means 0 GPUs with the reason. Inputs are raw bytes, JSON-shaped documents (valid JSON
with hostile values) and mutations of a valid file. FUZZ_EXAMPLES sets the number of examples
per property (small in the test command; `make fuzz` raises it).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fake_gpu.layout import LayoutError
from fake_gpu.layout_source import layout_for, parse_entry
from gpu_agent.foundations import fake_state
from gpu_agent.foundations.config import VERBOSITY, ConfigError, Setting, load
from gpu_agent.foundations.gpus import GPU, Inventory
from gpu_agent.mechanisms.inventory.fake import FakeFileSource

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=30)

VALID_STATE = fake_state.render(Inventory((GPU("GPU-00000000-0000-4000-8000-000000000001", "NVIDIA H100", 1 << 36),)))


def mutations(text: str) -> st.SearchStrategy[bytes]:
    raw = text.encode()

    @st.composite
    def mutate(draw: st.DrawFn) -> bytes:
        data = bytearray(raw)
        for _ in range(draw(st.integers(1, 8))):
            op = draw(st.sampled_from(["flip", "cut", "insert", "dup"]))
            at = draw(st.integers(0, max(0, len(data) - 1)))
            if op == "flip" and data:
                data[at] = draw(st.integers(0, 255))
            elif op == "cut":
                del data[at:at + draw(st.integers(1, 20))]
            elif op == "insert":
                data[at:at] = draw(st.binary(min_size=1, max_size=10))
            else:
                data[at:at] = data[at:at + draw(st.integers(1, 40))]
        return bytes(data)

    return mutate()


def state_inputs() -> st.SearchStrategy[bytes]:
    documents = st.fixed_dictionaries({"apiVersion": st.just(fake_state.API_VERSION) | st.text(max_size=5),
                                       "gpus": st.lists(st.dictionaries(st.sampled_from(
                                           ["uuid", "name", "memoryTotalBytes", "migMode", "x"]), json_values,
                                           max_size=5), max_size=4) | json_values})
    return (st.binary(max_size=400) | mutations(VALID_STATE)
            | documents.map(lambda d: json.dumps(d).encode())
            | st.integers(1, 5000).map(lambda n: b"[" * n + b"]" * n))


@FUZZ
@given(state_inputs())
def test_fake_state_file_parses_or_says_why_and_the_source_then_reads_zero_gpus(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fake-gpus.json"
        path.write_bytes(data)
        try:
            inventory = fake_state.read(path)
        except fake_state.FakeStateError as e:
            assert str(e)
            reading = FakeFileSource(path).read()
            assert reading.error and reading.inventory.count == 0
        else:
            assert all(g.uuid.startswith("GPU-") for g in inventory.gpus)
            assert FakeFileSource(path).read().inventory.uuids == inventory.uuids


def layout_inputs() -> st.SearchStrategy[str]:
    return (st.text(max_size=200) | json_values.map(json.dumps)
            | st.dictionaries(st.sampled_from(["count", "product", "memoryMiB", "other"]), json_values, max_size=4)
            .map(json.dumps))


@FUZZ
@given(layout_inputs(), st.dictionaries(st.sampled_from(["maxCount", "n1", "n2"]), st.text(max_size=30), max_size=3))
def test_fake_gpu_layout_parses_or_raises_layout_error(entry, data):
    try:
        layout = parse_entry(entry, "n1", 64)
    except LayoutError as e:
        assert str(e)
    else:
        assert 0 <= layout.count <= 64 and layout.memory_mib > 0
    try:
        layout_for(data, "n1", 0)
    except LayoutError as e:
        assert str(e)


SETTINGS = [VERBOSITY, Setting("clusterId", "str", "local", "x"), Setting("gpuPollInterval", "seconds", 0.5, "x", 0.05, 60),
            Setting("executor", "choice", "record", "x", choices=("record", "pod")),
            Setting("featureGates", "featureGates", "", "x", optional=True),
            Setting("listenAddress", "address", "127.0.0.1:8080", "x"), Setting("controlPlaneUrl", "url", "http://x", "x")]


def config_inputs() -> st.SearchStrategy[bytes]:
    yaml_docs = st.dictionaries(st.sampled_from([s.name for s in SETTINGS] + ["bogus"]), json_values, max_size=5)
    return (st.binary(max_size=300) | yaml_docs.map(lambda d: json.dumps(d).encode())
            | mutations("verbosity: 2\nclusterId: prod\ngpuPollInterval: 0.5\nexecutor: pod\n")
            | st.integers(1, 3000).map(lambda n: b"[" * n + b"]" * n))


@FUZZ
@given(config_inputs())
def test_config_file_loads_or_raises_config_error(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_bytes(data)
        try:
            cfg = load(SETTINGS, argparse.Namespace(config=str(path)), environ={})
        except ConfigError as e:
            assert str(e) and "\n" not in str(e)
        else:
            assert 0 <= cfg.verbosity <= 7 and 0.05 <= cfg.gpuPollInterval <= 60
