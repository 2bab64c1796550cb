"""Benchmark (printed, not asserted): how many fake GPUs one node can carry, and what breaks first (issue 45).

Each stage a node's GPUs pass through, for N GPUs on the node, every one of them faulted (the largest
form of each document), with the real code:

  layout     the node's entry in the layout ConfigMap (`fake-gpu set/fault --node`): its JSON size
             against the entry limit (layout_source.max_layout_chars) and the ConfigMap's 1 MiB, and
             the DaemonSet's parse (layout_source.parse_entry)
  build      layout -> inventory (fake_gpu.layout.build), once from nothing and once again (kept UUIDs)
  state      the state file the DaemonSet writes and the node agent reads: its size against
             fake_state.MAX_FILE_BYTES, the render and the parse (fake_state's own limits lifted here,
             so the cost past them shows too)
  plugin     the device plugin over real gRPC on a unix socket, with a client of gRPC's defaults as
             kubelet's is (4 MiB received at most): the first ListAndWatch answer (time, bytes), an
             Allocate of the most GPUs one container may be given (time), and whether one of every
             device is refused (its NVIDIA_VISIBLE_DEVICES against execve's 128 KiB limit on one
             environment string, which the plugin checks)

Reasons: "short" is what `fake-gpu fault --xid 48` writes; "long" is the longest a fault may carry
(fake_state.MAX_REASON characters). Times are the median of REPEAT runs on this machine.

    PYTHONPATH=agent:fake-gpu python agent/bench/bench_fake_gpu_node.py     (make bench-fake-gpu)
    BENCH_COUNTS=1024,4096   the node sizes to try
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from fake_gpu import layout_source
from fake_gpu.deviceplugin import api_pb2, api_pb2_grpc
from fake_gpu.layout import Fault, build
from fake_gpu.layout_source import NodeLayout, parse_entry, with_faults
from fake_gpu.plugin import Devices, PluginRunner, max_visible_devices
from gpu_agent.foundations import fake_state
from gpu_agent.foundations.gpus import UNHEALTHY, Inventory
from gpu_agent.foundations.xids import describe_xid

COUNTS = [int(c) for c in os.environ.get("BENCH_COUNTS", "64,256,1024,2048,4096,8192,16384,65536,81920").split(",")]
REPEAT = int(os.environ.get("BENCH_REPEAT", "5"))
CONFIGMAP_BYTES = 1 << 20  # the API server's limit on a ConfigMap's data
GRPC_RECEIVE = 4 << 20  # gRPC's default most bytes a client receives in one message (kubelet sets none)
ARG_STRLEN = 32 * 4096  # Linux MAX_ARG_STRLEN: the longest single environment string execve takes
REASONS = {"short": describe_xid(48), "long": "R" * fake_state.MAX_REASON}


def median_ms(fn: Callable[[], object]) -> float:
    times = []
    for _ in range(REPEAT):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def layout_stage(n: int, reason: str) -> tuple[str, float, int]:
    layout = NodeLayout(n, faults=with_faults({i: Fault(UNHEALTHY, reason) for i in range(n)}))
    text = layout.to_json()
    return text, median_ms(lambda: parse_entry(text, "node-1", n)), len(text.encode())


def plugin_stage(inventory: Inventory, folder: Path) -> tuple[float, int, str, float, int, str]:
    """(first ListAndWatch ms, its bytes or 0, its error, Allocate ms, NVIDIA_VISIBLE_DEVICES of every device in bytes,
    why an Allocate of every device was refused or "")."""
    devices = Devices()
    devices.set(inventory)
    runner = PluginRunner(folder, devices, "/host/state.json")
    runner._serve()  # no kubelet to register with: the client below stands in for it
    try:
        with grpc.insecure_channel(f"unix://{runner.socket}") as channel:
            stub = api_pb2_grpc.DevicePluginStub(channel)
            started = time.perf_counter()
            stream = stub.ListAndWatch(api_pb2.Empty(), timeout=30)
            try:
                first = next(stream)
                listed_ms, size, error = (time.perf_counter() - started) * 1000, first.ByteSize(), ""
            except grpc.RpcError as e:
                listed_ms, size, error = (time.perf_counter() - started) * 1000, 0, f"{e.code().name}: {e.details()[:60]}"
            stream.cancel()
            ids = [g.uuid for g in inventory.gpus]

            def allocate(some: list[str]) -> object:
                request = api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=some)])
                return stub.Allocate(request, timeout=30)
            # The most one container may be given (plugin.max_visible_devices), timed; then every device, which
            # the plugin refuses past that (execve's limit on one environment string).
            allocate_ms = median_ms(lambda: allocate(ids[:max_visible_devices()]))
            try:
                allocate(ids)
                refused = ""
            except grpc.RpcError as e:
                refused = f"Allocate of all {len(ids)}: {e.code().name}"
    finally:
        runner.stopping.set()
        if runner._server is not None:
            runner._server.stop(grace=0)
    return listed_ms, size, error, allocate_ms, len("NVIDIA_VISIBLE_DEVICES=") + len(",".join(ids)) + 1, refused


def row(n: int, name: str, reason: str, rng: random.Random, count_limit: int, file_limit: int, gpu_limit: int) -> str:
    """One line of the table: node size `n`, every GPU faulted with `reason`."""
    text, parse_ms, layout_bytes = layout_stage(n, reason)
    layout = parse_entry(text, "node-1", n) if len(text) <= layout_source.max_layout_chars(n) else None
    faults = {i: Fault(UNHEALTHY, reason) for i in range(n)}
    inventory = build(Inventory(), n, "NVIDIA H100 80GB HBM3", 81559, rng, n, "", faults)
    build_ms = median_ms(lambda: build(Inventory(), n, "NVIDIA H100 80GB HBM3", 81559, rng, n, "", faults))
    rebuild_ms = median_ms(lambda: build(inventory, n, "NVIDIA H100 80GB HBM3", 81559, rng, n, "", faults))
    state = fake_state.render(inventory, node="node-1")
    render_ms = median_ms(lambda: fake_state.render(inventory, node="node-1"))
    state_parse_ms = median_ms(lambda: fake_state.parse(state))
    with tempfile.TemporaryDirectory() as folder:
        lw_ms, lw_bytes, lw_error, alloc_ms, env_bytes, refused = plugin_stage(inventory, Path(folder))
    breaks = []
    if n > count_limit:
        breaks.append(f"maxCount {count_limit}")
    if layout is None:
        breaks.append("layout entry limit")
    if layout_bytes > CONFIGMAP_BYTES:
        breaks.append("ConfigMap 1 MiB")
    if len(state.encode()) > file_limit or n > gpu_limit:
        breaks.append("state file limit")
    if lw_error:
        breaks.append(f"ListAndWatch {lw_error}")
    if refused:
        breaks.append(f"{refused} (its environment string {env_bytes} B > {ARG_STRLEN})")
    return (f"{n:>6} {name:>6} | {layout_bytes:>9} {layout_source.max_layout_chars(n):>9} {parse_ms:>8.1f} | "
            f"{build_ms:>8.1f} {rebuild_ms:>8.1f} | {len(state.encode()):>9} {render_ms:>9.1f} {state_parse_ms:>8.1f} | "
            f"{lw_ms:>7.1f} {lw_bytes:>8} {alloc_ms:>8.1f} {env_bytes:>8}  {'; '.join(breaks) or '-'}")


def main() -> int:
    # The state file's own limits are lifted so that the parse is timed past them; the table says where they are.
    file_limit, gpu_limit, count_limit = fake_state.MAX_FILE_BYTES, fake_state.MAX_GPUS, layout_source.MAX_COUNT
    fake_state.MAX_FILE_BYTES, fake_state.MAX_GPUS, layout_source.MAX_COUNT = 1 << 30, 1 << 30, 1 << 30
    print(f"limits: maxCount {count_limit} (a layout entry of {layout_source.max_layout_chars(count_limit)} chars); "
          f"ConfigMap {CONFIGMAP_BYTES} bytes; state file {file_limit} bytes, {gpu_limit} GPUs; "
          f"gRPC message {GRPC_RECEIVE} bytes; one environment string {ARG_STRLEN} bytes")
    print(f"{'GPUs':>6} {'reason':>6} | {'layout B':>9} {'entry lim':>9} {'parse ms':>8} | {'build ms':>8} {'rebuild':>8} | "
          f"{'state B':>9} {'render ms':>9} {'parse ms':>8} | {'L&W ms':>7} {'L&W B':>8} {'alloc ms':>8} {'env B':>8}  breaks")
    rng = random.Random(45)
    for n in COUNTS:
        for name, reason in REASONS.items():
            print(row(n, name, reason, rng, count_limit, file_limit, gpu_limit), flush=True)
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    sys.exit(main())
