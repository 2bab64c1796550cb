"""`fake-gpu`: make fake GPUs arrive and leave at runtime.

On this machine (the agent's local mode), the state file is `--state-file`, else
$FAKE_GPU_STATE_FILE, else .run/fake-gpus.json:

    fake-gpu set --count 4 [--product NAME] [--memory-mib N] [--clique NAME]
    fake-gpu cycle --from 0 --to 4 --times 3 [--interval 2]
    fake-gpu fault --gpu 1 (--xid 79 | --ecc single|double | --lost)     fake-gpu fault --clear [--gpu 1]
    fake-gpu status
    fake-gpu --version

On a cluster with charts/fake-gpu installed, name the node (KUBECONFIG as usual):

    fake-gpu set --node NODE --count N [--clique rack-a]     fake-gpu status --node any
    fake-gpu cycle --node NODE --from 0 --to 4 --times 3
    fake-gpu fault --node NODE --gpu 0 --xid 48              fake-gpu fault --node NODE --clear

A fault is classified as the agents classify real errors (gpu_agent.foundations.xids): an application
Xid (13, 31, 43, 45, 68, 109) or a single-bit ECC error changes nothing; Xid 79 and --lost make the GPU
Lost; any other Xid and a double-bit ECC error make it Unhealthy. `--clear` makes it Healthy again.

Inside the cluster: `fake-gpu --release R daemon` (the DaemonSet; it labels its node as GPU feature
discovery would; `daemon --no-device-plugin` where the node agent offers the GPUs through DRA; on a real GPU
node it refuses and idles unless `daemon --allow-real-gpu-nodes`; `--resource-name` advertises another name),
`fake-gpu --release R unlabel-nodes` (the chart's post-delete hook) and
`fake-gpu smi -L` (in a workload).
Bad input is refused with a message and changes nothing (exit code 2).

`--log-format text|json` (before or after the command; the chart's value logFormat): text, the default, is the lines
as they always were; json writes every log line (the daemon's, unlabel-nodes' report, an error) as gpu-agent's
`--log-format json` does, one JSON object a line on stderr with the same keys, secrets redacted alike. A command's
output (status's JSON, set's, cycle's and fault's report, smi's list) stays on stdout as it is.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from fake_gpu.layout import (
    DEFAULT_MEMORY_MIB,
    DEFAULT_PRODUCT,
    MAX_GPUS,
    Fault,
    LayoutError,
    build,
    classify,
    faults_of,
)
from fake_gpu.layout_source import LEGACY_CONFIGMAP
from fake_gpu.real_gpu_guard import DEFAULT_RESOURCE, check_resource_name
from gpu_agent.foundations import fake_state, klog
from gpu_agent.foundations.gpus import GPU, HEALTHY, Inventory
from gpu_agent.foundations.secrets import REDACTOR
from gpu_agent.foundations.version import VersionAction

if TYPE_CHECKING:
    from fake_gpu.cluster import ClusterLayout  # imported when used: it loads the Kubernetes client

DEFAULT_NAMESPACE = os.environ.get("FAKE_GPU_NAMESPACE", "gpu-agent")


def _current(path: Path) -> Inventory:
    try:
        return fake_state.read(path)
    except fake_state.FakeStateError:
        return Inventory()  # a missing or broken file is replaced whole by `set`


def _set_local(path: Path, count: int, product: str, memory_mib: int, max_gpus: int, clique: str | None) -> str:
    current = _current(path)
    inventory = build(current, count, product, memory_mib, random.Random(), max_gpus,
                      current.clique if clique is None else clique, faults_of(current))
    _write_local(path, inventory)
    return f"{path}: {inventory.count} fake GPUs" + (f", clique {inventory.clique}" if inventory.clique else "")


def _write_local(path: Path, inventory: Inventory) -> None:
    try:
        fake_state.write_atomic(path, fake_state.render(inventory, node="local"))
    except OSError as e:
        raise LayoutError(f"cannot write the state file {path}: {e.strerror or e}; "
                          "choose a writable one with --state-file PATH") from None


def _fault_local(path: Path, gpu: int | None, fault: Fault | None, clear: bool) -> str:
    current = fake_state.read(path)
    if gpu is not None and not 0 <= gpu < current.count:
        raise LayoutError(f"--gpu must be between 0 and {current.count - 1} ({path} has {current.count} fake GPUs), "
                          f"got {gpu}")
    if not clear and fault is None:
        return ""  # an error that does not act: the file stays as it is

    def mended(g: GPU) -> GPU:
        if gpu is not None and g.index != gpu:
            return g
        if fault is None:
            return replace(g, health=HEALTHY, health_reason="")
        return replace(g, health=fault.health, health_reason=fault.reason)

    _write_local(path, replace(current, gpus=tuple(mended(g) for g in current.gpus)))
    return str(path)


def _fault_message(where: str, gpu: int | None, fault: Fault | None, clear: bool, why: str) -> str:
    if clear:
        return f"{where}: " + ("every fault cleared (all GPUs Healthy)" if gpu is None else f"GPU {gpu} cleared (Healthy)")
    if fault is None:
        return f"{where}: GPU {gpu} unchanged: {why}"
    return f"{where}: GPU {gpu} is now {fault.health}: {fault.reason}" + (f"; {why}" if why else "")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fake-gpu", description="fake GPUs that arrive and leave at runtime")
    # The same build identity as `gpu-agent --version`: one image carries both commands.
    parser.add_argument("--version", action=VersionAction)
    parser.add_argument("--state-file", type=Path, default=None, help="local state file (default: $FAKE_GPU_STATE_FILE or .run/fake-gpus.json)")
    parser.add_argument("--namespace", default=DEFAULT_NAMESPACE, help=f"namespace of the fake-gpu install (cluster mode; default {DEFAULT_NAMESPACE!r}, env FAKE_GPU_NAMESPACE)")
    parser.add_argument("--kubeconfig", default=None, help="kubeconfig (cluster mode; default: $KUBECONFIG)")
    parser.add_argument("--release", default=os.environ.get("FAKE_GPU_RELEASE") or None,
                        help="the fake-gpu release to change, when the namespace holds several (cluster mode; env FAKE_GPU_RELEASE)")
    parser.add_argument("--resource-name", default=DEFAULT_RESOURCE,
                        help=f"the extended resource the daemon advertises and labels after, and unlabel-nodes takes off "
                             f"(default {DEFAULT_RESOURCE!r})")
    sub = parser.add_subparsers(dest="command", required=True)
    p_set = sub.add_parser("set", help="set the number of fake GPUs")
    p_cycle = sub.add_parser("cycle", help="go back and forth between two counts")
    p_status = sub.add_parser("status", help="print the current fake GPUs as JSON")
    p_fault = sub.add_parser("fault", help="break one fake GPU as a real one breaks (an Xid, an ECC error, lost), or "
                                           "clear faults")
    p_fault.add_argument("--gpu", type=int, default=None, help="the GPU's index, 0-based (required but with --clear, "
                                                               "which without it clears every GPU)")
    what = p_fault.add_mutually_exclusive_group(required=True)
    what.add_argument("--xid", type=int, default=None, help="a critical Xid: 79 makes the GPU Lost, 13, 31, 43, 45, 68 "
                                                            "and 109 (application errors) change nothing, any other "
                                                            "makes it Unhealthy")
    what.add_argument("--ecc", choices=("single", "double"), default=None,
                      help="an ECC error: double makes the GPU Unhealthy, single is corrected and changes nothing")
    what.add_argument("--lost", action="store_true", help="the GPU stops answering (NVML_ERROR_GPU_IS_LOST)")
    what.add_argument("--clear", action="store_true", help="make the GPU (or, without --gpu, every GPU) Healthy again")
    for p in (p_set, p_cycle):
        p.add_argument("--product", default=DEFAULT_PRODUCT, help=f"product name (default {DEFAULT_PRODUCT!r})")
        p.add_argument("--memory-mib", type=int, default=DEFAULT_MEMORY_MIB, help=f"memory per GPU in MiB (default {DEFAULT_MEMORY_MIB})")
        p.add_argument("--max", type=int, default=MAX_GPUS, dest="max_gpus", help=f"largest count accepted locally (default {MAX_GPUS})")
        p.add_argument("--clique", default=None, help="the node's fake NVLink clique (a rack), e.g. rack-a; '' for none "
                                                      "(default: keep the current one)")
    for p in (p_set, p_cycle, p_status, p_fault):
        p.add_argument("--node", default=None, help="a cluster node: change its layout on the cluster instead of a local file")
        # Also after the subcommand, where people (and our own error messages) put it.
        p.add_argument("--state-file", type=Path, default=argparse.SUPPRESS, dest="state_file",
                       help="local state file (default: $FAKE_GPU_STATE_FILE or .run/fake-gpus.json)")
    p_set.add_argument("--count", type=int, required=True, help="number of GPUs, 0 or more (required)")
    p_cycle.add_argument("--from", type=int, dest="low", default=0, help="the count each cycle ends at (default 0)")
    p_cycle.add_argument("--to", type=int, dest="high", default=4, help="the count each cycle starts at (default 4)")
    p_cycle.add_argument("--times", type=int, default=3, help="how many cycles of --to then --from (default 3)")
    p_cycle.add_argument("--interval", type=float, default=2.0, help="seconds between changes (default 2)")
    p_daemon = sub.add_parser("daemon", help="(in the DaemonSet) apply this node's layout and run the device plugin (unless --no-device-plugin)")
    p_daemon.add_argument("--node-name", default=os.environ.get("NODE_NAME", ""), required=not os.environ.get("NODE_NAME"),
                          help="this node's name (default: $NODE_NAME)")
    p_daemon.add_argument("--plugin-dir", type=Path, default=Path("/var/lib/kubelet/device-plugins"),
                          help="kubelet's device-plugin folder (default /var/lib/kubelet/device-plugins)")
    p_daemon.add_argument("--host-state-file", default=None, help="the state file's path on the host (for Allocate's mount)")
    p_daemon.add_argument("--device-plugin", action=argparse.BooleanOptionalAction, default=True,
                          help="run the kubelet device plugin (nvidia.com/gpu); --no-device-plugin on a node whose GPUs the "
                               "node agent offers through DRA: the layout, state file and labels only (default: run it)")
    p_daemon.add_argument("--layout-configmap", default=LEGACY_CONFIGMAP,
                          help=f"the layout ConfigMap to watch in --namespace (default {LEGACY_CONFIGMAP!r}; the chart passes its own)")
    p_daemon.add_argument("--default-count", type=int, default=0,
                          help="fake GPUs on a node whose layout is not set yet (default 0)")
    p_daemon.add_argument("--allow-real-gpu-nodes", action="store_true",
                          help="advertise and label even on a node that looks like a real GPU node (its capacity has the "
                               "resource from another plugin, or NVIDIA devices are on the host); default: refuse there")
    p_daemon.add_argument("--refusal-file", type=Path, default=None,
                          help="where a refusal is written, for the readiness probe to print (default: not written)")
    p_daemon.add_argument("-v", type=int, default=0, dest="verbosity", help="log verbosity 0..7 (default 0)")
    sub.add_parser("unlabel-nodes", help="(the chart's post-delete hook) remove the GPU labels release --release put on nodes")
    p_smi = sub.add_parser("smi", help="(in a workload) list the fake GPUs this container was given, like nvidia-smi -L")
    p_smi.add_argument("-L", action="store_true", dest="list_gpus", required=True)
    log_help = ("the log line format: text (as always) or json (one JSON object a line on stderr, as gpu-agent's "
                "--log-format json: ts, level, v, logger, caller, msg, pid, thread, err), secrets redacted in both; a "
                "command's output stays on stdout as it is (default text)")
    parser.add_argument("--log-format", choices=klog.FORMATS, default="text", dest="log_format", help=log_help)
    for p in sub.choices.values():  # also after the command, as -v and gpu-agent's own --log-format
        p.add_argument("--log-format", choices=klog.FORMATS, default=argparse.SUPPRESS, dest="log_format", help=log_help)
    return parser


# The logger of the command's own lines in JSON (the daemon's modules have theirs): under klog's root, which
# klog.setup points at stderr.
log = logging.getLogger(f"{klog.ROOT}.fake_gpu.cli")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    as_json = args.log_format == "json"
    if as_json:  # from the first line on (the daemon sets it up again with its verbosity)
        klog.setup(0, log_format="json")
    try:
        return _run(args)
    except (LayoutError, fake_state.FakeStateError) as e:
        if as_json:
            log.error("%s", e)
        else:
            print(REDACTOR.scrub(f"fake-gpu: error: {e}"), file=sys.stderr)
        return 2
    except Exception:
        if not as_json:
            raise  # text: Python's traceback, as always
        log.error("fake-gpu %s failed", args.command, exc_info=True)
        return 1


def _run(args: argparse.Namespace) -> int:
    path = args.state_file or fake_state.default_path()
    if args.command == "smi":
        from fake_gpu.smi import list_gpus

        print("\n".join(list_gpus()))
        return 0
    if args.command in ("daemon", "unlabel-nodes") and (why := check_resource_name(args.resource_name)):
        raise LayoutError(f"--resource-name: {why}")
    if args.command == "daemon":
        from fake_gpu.daemon import run

        klog.setup(args.verbosity, log_format=args.log_format)
        return run(args.node_name, args.namespace, args.layout_configmap, path, args.host_state_file or str(path), args.plugin_dir,
                   args.default_count, args.release or "", device_plugin=args.device_plugin,
                   resource=args.resource_name, allow_real_gpu_nodes=args.allow_real_gpu_nodes,
                   refusal_file=args.refusal_file)
    if args.command == "unlabel-nodes":
        from fake_gpu.cluster import unlabel_nodes

        if not args.release:
            raise LayoutError("unlabel-nodes needs --release NAME (the fake-gpu release whose labels to remove)")
        names = unlabel_nodes(args.kubeconfig, args.release, args.resource_name)
        said = f"removed release {args.release}'s GPU labels from {len(names)} node(s)" + (f": {', '.join(names)}" if names else "")
        if args.log_format == "json":
            log.info("%s", said)  # a hook Job's report: a log line
        else:
            print(said)
        return 0
    cluster = None
    if args.node:
        from fake_gpu.cluster import ClusterLayout

        cluster = ClusterLayout(args.namespace, args.kubeconfig, args.release)
    if args.command == "fault":
        return _fault(args, path, cluster)
    if args.command == "status":
        if cluster is not None:
            print(json.dumps(cluster.status(), indent=2))
        else:
            inventory = fake_state.read(path)
            print(json.dumps({"stateFile": str(path), "count": inventory.count,
                              "gpus": fake_state.gpus_json(inventory)}, indent=2))
        return 0

    def set_count(count: int) -> str:
        if cluster is not None:
            layout = cluster.set(args.node, count, args.product, args.memory_mib, args.clique)
            return f"node {args.node}: {layout.count} fake GPUs" + (f", clique {layout.clique}" if layout.clique else "")
        return _set_local(path, count, args.product, args.memory_mib, args.max_gpus, args.clique)

    if not 1 <= args.max_gpus <= fake_state.MAX_GPUS:
        raise LayoutError(f"--max must be between 1 and {fake_state.MAX_GPUS} (the most GPUs the agent reads from one "
                          f"node's state file), got {args.max_gpus}")
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
    return 0


def _fault(args: argparse.Namespace, path: Path, cluster: ClusterLayout | None) -> int:
    if args.gpu is None and not args.clear:
        raise LayoutError("--gpu INDEX is required (which GPU to break; `fake-gpu status` lists them)")
    fault, why = (None, "") if args.clear else classify(args.xid, args.ecc, args.lost)
    acts = args.clear or fault is not None
    if cluster is not None:
        cluster.fault(args.node, args.gpu, fault, write=acts)
        where = f"node {args.node}"
    else:
        where = _fault_local(path, args.gpu, fault, args.clear) or str(path)
    print(_fault_message(where, args.gpu, fault, args.clear, why))
    return 0
