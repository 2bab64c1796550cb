"""How many fake GPUs one node carries (issue 45): maxCount up to layout_source.MAX_COUNT, every stage
sized for it (layout entry, state file, ListAndWatch), and a container given more GPUs than its
NVIDIA_VISIBLE_DEVICES can hold refused by Allocate, naming the limit. The figures behind MAX_COUNT
are agent/bench/bench_fake_gpu_node.py's."""

from __future__ import annotations

import json
import random
from pathlib import Path

import grpc
import pytest
from test_plugin import plugin, stub  # noqa: F401 - the fixture, a stand-in kubelet

from fake_gpu import layout_source
from fake_gpu.deviceplugin import api_pb2
from fake_gpu.layout import Fault, LayoutError, build
from fake_gpu.layout_source import (
    MAX_COUNT,
    NodeLayout,
    layout_for,
    max_count,
    max_layout_chars,
    parse_entry,
    with_faults,
)
from fake_gpu.plugin import MAX_ENV_STRING, max_visible_devices
from gpu_agent.foundations import fake_state
from gpu_agent.foundations.gpus import GPU, UNHEALTHY, Inventory
from gpu_agent.foundations.xids import describe_xid

CHART = Path(__file__).resolve().parents[2] / "charts" / "fake-gpu"
LONG_REASON = "R" * fake_state.MAX_REASON


def every_gpu_faulted(count: int, reason: str) -> NodeLayout:
    return NodeLayout(count, faults=with_faults({i: Fault(UNHEALTHY, reason) for i in range(count)}))


def test_the_chart_allows_exactly_what_the_daemon_and_the_node_agent_accept():
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]
    assert MAX_COUNT == fake_state.MAX_GPUS == 8192
    assert schema["maxCount"]["maximum"] == schema["defaultCount"]["maximum"] == MAX_COUNT
    assert max_count({"maxCount": str(MAX_COUNT)}) == MAX_COUNT
    assert max_count({"maxCount": str(MAX_COUNT + 1)}) == 64  # out of range: the built-in default, as before


@pytest.mark.parametrize("reason", [describe_xid(48), LONG_REASON], ids=["short", "long"])
def test_a_node_of_max_count_gpus_each_faulted_parses_and_one_gpu_more_is_refused(reason):
    text = every_gpu_faulted(MAX_COUNT, reason).to_json()
    assert len(text) <= max_layout_chars(MAX_COUNT)
    layout = parse_entry(text, "n1", MAX_COUNT)
    assert layout.count == MAX_COUNT and layout.fault_map[MAX_COUNT - 1] == Fault(UNHEALTHY, reason)
    with pytest.raises(LayoutError, match=f"count must be at most maxCount={MAX_COUNT}, got {MAX_COUNT + 1}"):
        layout_for({"n1": every_gpu_faulted(MAX_COUNT + 1, reason).to_json(), "maxCount": str(MAX_COUNT)}, "n1", 0)


def test_a_layout_entry_longer_than_a_fault_on_every_gpu_needs_is_refused_naming_the_limit_and_the_fix():
    assert max_layout_chars(64) > 16384  # the old fixed limit held no long reason on each of 64 GPUs
    assert len(every_gpu_faulted(64, LONG_REASON).to_json()) <= max_layout_chars(64)
    padded = json.dumps({"count": 1, "product": "x" * max_layout_chars(8)})
    with pytest.raises(LayoutError) as e:
        parse_entry(padded, "n1", 8)
    assert f"more than the {max_layout_chars(8)} a node of at most maxCount=8 GPUs needs" in str(e.value)
    assert "fake-gpu set --node n1 --count N" in str(e.value)


def test_the_state_file_of_max_count_gpus_each_faulted_is_read_and_one_more_is_refused():
    inventory = build(Inventory(), MAX_COUNT, "NVIDIA H100 80GB HBM3", 81559, random.Random(4), MAX_COUNT, "",
                      {i: Fault(UNHEALTHY, LONG_REASON) for i in range(MAX_COUNT)})
    text = fake_state.render(inventory, node="a-node-name-of-some-length")
    assert len(text.encode()) < fake_state.MAX_FILE_BYTES
    assert fake_state.parse(text).count == MAX_COUNT
    more = json.loads(text)
    more["gpus"].append({**more["gpus"][0], "uuid": "GPU-ffffffff-ffff-4fff-bfff-ffffffffffff"})
    with pytest.raises(fake_state.FakeStateError, match=f"{MAX_COUNT + 1} GPUs; at most {MAX_COUNT}"):
        fake_state.parse(json.dumps(more))


def uuids(n: int) -> list[str]:
    return [f"GPU-{i:08x}-0000-4000-8000-000000000000" for i in range(n)]


def test_list_and_watch_carries_max_count_devices_and_allocate_refuses_a_container_past_its_environment(plugin):  # noqa: F811
    _, devices, runner = plugin
    ids = uuids(MAX_COUNT)
    devices.set(Inventory(tuple(GPU(u, "fake", 1 << 30, index=i) for i, u in enumerate(ids))))
    channel, dp = stub(runner)
    stream = dp.ListAndWatch(api_pb2.Empty())
    assert len(next(stream).devices) == MAX_COUNT  # about 450 KB of gRPC's 4 MiB
    stream.cancel()
    fits = max_visible_devices()
    assert fits == 3196
    answer = dp.Allocate(api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids[:fits])]))
    assert len(answer.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"]) < MAX_ENV_STRING
    with pytest.raises(grpc.RpcError) as refused:
        dp.Allocate(api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids[:fits + 1])]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (f"a container given {fits + 1} fake GPUs cannot start" in refused.value.details()
            and f"{MAX_ENV_STRING}-byte limit" in refused.value.details()
            and f"ask for at most {fits} GPUs per container" in refused.value.details()), refused.value.details()
    channel.close()


def test_the_bench_reads_the_limits_it_reports():
    # The bench lifts these to time past them; the module keeps its own.
    assert layout_source.MAX_COUNT == MAX_COUNT and fake_state.MAX_FILE_BYTES == 8 << 20


def test_fake_gpu_set_writes_a_state_file_of_max_count_gpus_and_refuses_a_max_the_agent_cannot_read(tmp_path, capsys):
    from fake_gpu.cli import main

    state = tmp_path / "gpus.json"
    assert main(["--state-file", str(state), "set", "--count", str(MAX_COUNT), "--max", str(MAX_COUNT)]) == 0
    assert fake_state.read(state).count == MAX_COUNT
    assert main(["--state-file", str(state), "set", "--count", "1", "--max", str(MAX_COUNT + 1)]) == 2
    assert f"--max must be between 1 and {MAX_COUNT}" in capsys.readouterr().err
    assert fake_state.read(state).count == MAX_COUNT  # nothing written
