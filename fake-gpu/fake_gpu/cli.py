"""`fake-gpu`: make fake GPUs arrive and leave at runtime.

On this machine (the agent's local mode), the state file is `--state-file`, else
$FAKE_GPU_STATE_FILE, else .run/fake-gpus.json:

    fake-gpu set --count 4 [--product NAME] [--memory-mib N] [--clique NAME]
    fake-gpu cycle --from 0 --to 4 --times 3 [--interval 2]
    fake-gpu status
    fake-gpu --version

On a cluster with charts/fake-gpu installed, name the node (KUBECONFIG as usual):

    fake-gpu set --node NODE --count N [--clique rack-a]     fake-gpu status --node any
    fake-gpu cycle --node NODE --from 0 --to 4 --times 3

Inside the cluster: `fake-gpu --release R daemon` (the DaemonSet; it labels its node as GPU feature
discovery would), `fake-gpu --release R unlabel-nodes` (the chart's post-delete hook) and
`fake-gpu smi -L` (in a workload).
Bad input is refused with a message and changes nothing (exit code 2).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

from fake_gpu.layout import DEFAULT_MEMORY_MIB, DEFAULT_PRODUCT, MAX_GPUS, LayoutError, build
from fake_gpu.layout_source import LEGACY_CONFIGMAP
from gpu_agent.foundations import fake_state, klog
from gpu_agent.foundations.gpus import Inventory
from gpu_agent.foundations.version import VersionAction

DEFAULT_NAMESPACE = os.environ.get("FAKE_GPU_NAMESPACE", "gpu-agent")


def _current(path: Path) -> Inventory:
    try:
        return fake_state.read(path)
    except fake_state.FakeStateError:
        return Inventory()  # a missing or broken file is replaced whole by `set`


def _set_local(path: Path, count: int, product: str, memory_mib: int, max_gpus: int, clique: str | None) -> str:
    current = _current(path)
    inventory = build(current, count, product, memory_mib, random.Random(), max_gpus,
                      current.clique if clique is None else clique)
    try:
        fake_state.write_atomic(path, fake_state.render(inventory, node="local"))
    except OSError as e:
        raise LayoutError(f"cannot write the state file {path}: {e.strerror or e}; "
                          "choose a writable one with --state-file PATH") from None
    return f"{path}: {inventory.count} fake GPUs" + (f", clique {inventory.clique}" if inventory.clique else "")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fake-gpu", description="fake GPUs that arrive and leave at runtime")
    # The same build identity as `gpu-agent --version`: one image carries both commands.
    parser.add_argument("--version", action=VersionAction)
    parser.add_argument("--state-file", type=Path, default=None, help="local state file (default: $FAKE_GPU_STATE_FILE or .run/fake-gpus.json)")
    parser.add_argument("--namespace", default=DEFAULT_NAMESPACE, help=f"namespace of the fake-gpu install (cluster mode; default {DEFAULT_NAMESPACE!r}, env FAKE_GPU_NAMESPACE)")
    parser.add_argument("--kubeconfig", default=None, help="kubeconfig (cluster mode; default: $KUBECONFIG)")
    parser.add_argument("--release", default=os.environ.get("FAKE_GPU_RELEASE") or None,
                        help="the fake-gpu release to change, when the namespace holds several (cluster mode; env FAKE_GPU_RELEASE)")
    sub = parser.add_subparsers(dest="command", required=True)
    p_set = sub.add_parser("set", help="set the number of fake GPUs")
    p_cycle = sub.add_parser("cycle", help="go back and forth between two counts")
    p_status = sub.add_parser("status", help="print the current fake GPUs as JSON")
    for p in (p_set, p_cycle):
        p.add_argument("--product", default=DEFAULT_PRODUCT, help=f"product name (default {DEFAULT_PRODUCT!r})")
        p.add_argument("--memory-mib", type=int, default=DEFAULT_MEMORY_MIB, help=f"memory per GPU in MiB (default {DEFAULT_MEMORY_MIB})")
        p.add_argument("--max", type=int, default=MAX_GPUS, dest="max_gpus", help=f"largest count accepted locally (default {MAX_GPUS})")
        p.add_argument("--clique", default=None, help="the node's fake NVLink clique (a rack), e.g. rack-a; '' for none "
                                                      "(default: keep the current one)")
    for p in (p_set, p_cycle, p_status):
        p.add_argument("--node", default=None, help="a cluster node: change its layout on the cluster instead of a local file")
        # Also after the subcommand, where people (and our own error messages) put it.
        p.add_argument("--state-file", type=Path, default=argparse.SUPPRESS, dest="state_file",
                       help="local state file (default: $FAKE_GPU_STATE_FILE or .run/fake-gpus.json)")
    p_set.add_argument("--count", type=int, required=True, help="number of GPUs, 0 or more (required)")
    p_cycle.add_argument("--from", type=int, dest="low", default=0, help="the count each cycle ends at (default 0)")
    p_cycle.add_argument("--to", type=int, dest="high", default=4, help="the count each cycle starts at (default 4)")
    p_cycle.add_argument("--times", type=int, default=3, help="how many cycles of --to then --from (default 3)")
    p_cycle.add_argument("--interval", type=float, default=2.0, help="seconds between changes (default 2)")
    p_daemon = sub.add_parser("daemon", help="(in the DaemonSet) apply this node's layout and run the device plugin")
    p_daemon.add_argument("--node-name", default=os.environ.get("NODE_NAME", ""), required=not os.environ.get("NODE_NAME"),
                          help="this node's name (default: $NODE_NAME)")
    p_daemon.add_argument("--plugin-dir", type=Path, default=Path("/var/lib/kubelet/device-plugins"),
                          help="kubelet's device-plugin folder (default /var/lib/kubelet/device-plugins)")
    p_daemon.add_argument("--host-state-file", default=None, help="the state file's path on the host (for Allocate's mount)")
    p_daemon.add_argument("--layout-configmap", default=LEGACY_CONFIGMAP,
                          help=f"the layout ConfigMap to watch in --namespace (default {LEGACY_CONFIGMAP!r}; the chart passes its own)")
    p_daemon.add_argument("--default-count", type=int, default=0,
                          help="fake GPUs on a node whose layout is not set yet (default 0)")
    p_daemon.add_argument("-v", type=int, default=0, dest="verbosity", help="log verbosity 0..7 (default 0)")
    sub.add_parser("unlabel-nodes", help="(the chart's post-delete hook) remove the GPU labels release --release put on nodes")
    p_smi = sub.add_parser("smi", help="(in a workload) list the fake GPUs this container was given, like nvidia-smi -L")
    p_smi.add_argument("-L", action="store_true", dest="list_gpus", required=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    path = args.state_file or fake_state.default_path()
    try:
        if args.command == "smi":
            from fake_gpu.smi import list_gpus

            print("\n".join(list_gpus()))
            return 0
        if args.command == "daemon":
            from fake_gpu.daemon import run

            klog.setup(args.verbosity)
            return run(args.node_name, args.namespace, args.layout_configmap, path, args.host_state_file or str(path), args.plugin_dir,
                       args.default_count, args.release or "")
        if args.command == "unlabel-nodes":
            from fake_gpu.cluster import unlabel_nodes

            if not args.release:
                raise LayoutError("unlabel-nodes needs --release NAME (the fake-gpu release whose labels to remove)")
            names = unlabel_nodes(args.kubeconfig, args.release)
            print(f"removed release {args.release}'s GPU labels from {len(names)} node(s)" + (f": {', '.join(names)}" if names else ""))
            return 0
        cluster = None
        if args.node:
            from fake_gpu.cluster import ClusterLayout

            cluster = ClusterLayout(args.namespace, args.kubeconfig, args.release)
        if args.command == "status":
            if cluster is not None:
                print(json.dumps(cluster.status(), indent=2))
            else:
                inventory = fake_state.read(path)
                print(json.dumps({"stateFile": str(path), "count": inventory.count, "gpus": inventory.to_json()}, indent=2))
            return 0

        def set_count(count: int) -> str:
            if cluster is not None:
                layout = cluster.set(args.node, count, args.product, args.memory_mib, args.clique)
                return f"node {args.node}: {layout.count} fake GPUs" + (f", clique {layout.clique}" if layout.clique else "")
            return _set_local(path, count, args.product, args.memory_mib, args.max_gpus, args.clique)

        if args.max_gpus < 1:
            raise LayoutError(f"--max must be 1 or more, got {args.max_gpus}")
        if args.command == "set":
            print(set_count(args.count))
        else:
            if args.times < 1:
                raise LayoutError(f"--times must be 1 or more, got {args.times}")
            if not 0 <= args.interval <= 3600:  # NaN fails too
                raise LayoutError(f"--interval must be between 0 and 3600 seconds, got {args.interval}")
            for flag, value in (("--from", args.low), ("--to", args.high)):
                if not 0 <= value <= args.max_gpus:
                    raise LayoutError(f"{flag} must be between 0 and --max ({args.max_gpus}), got {value}")
            for k in range(args.times):
                for count in (args.high, args.low):
                    print(f"cycle {k + 1}/{args.times}: {set_count(count)}", flush=True)
                    time.sleep(args.interval)
    except (LayoutError, fake_state.FakeStateError) as e:
        print(f"fake-gpu: error: {e}", file=sys.stderr)
        return 2
    return 0
