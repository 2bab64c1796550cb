"""`gpu-agent`: one command, one subcommand per role.

    gpu-agent local           control plane + cluster agent + fake GPUs on loopback (the main job)
    gpu-agent cluster-agent   the cluster agent alone
    gpu-agent node-agent      the node agent (one per GPU node)
    gpu-agent control-plane   the reference control plane alone
    gpu-agent inventory       read the GPU source once and print the inventory as JSON
    gpu-agent queue list|add  the control plane's work queue (admin token), e.g. beside `make run`
    gpu-agent chart-test      what `helm test` runs in the chart's test Pod: the release's endpoints answer (roles/chart_test.py)
    gpu-agent workload        a multi-node workload (nickelpie, nvbandwidth) in the Pods of a GPUDomain (roles/workload.py)
    gpu-agent completion      print a bash or zsh completion script, made from this parser (foundations/completion.py)
    gpu-agent version         (or `gpu-agent --version`)

The listing commands (`queue list`, `inventory`) take `-o json|yaml|wide`: json and yaml print one document of a
fixed shape (`queue list`'s is gpu_agent/schemas/queue-list.schema.json, `inventory`'s inventory.schema.json, both
checked by the unit tests), wide a table with every column. Without -o each prints what it printed before.

The process's exit codes are EXIT_CODES below, printed by `--help` and in docs/cli.md: bad flags and bad values
exit with code 2 and a message naming the setting; a cluster agent (or `local` with --graceful-no-gpu=false) that
starts with no GPUs and gracefulNoGPU off exits with code 3, its last log line saying why (roles/cluster_agent.py).
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import logging
import os
import re
import signal
import sys
import textwrap
from datetime import UTC, datetime
from typing import Any, NoReturn

import yaml

from gpu_agent.foundations import completion, klog
from gpu_agent.foundations.clock import SystemClock
from gpu_agent.foundations.config import LOGGING, Config, ConfigError, RoleConfig, Setting, add_arguments, load
from gpu_agent.foundations.control_plane_client import (
    TRANSPORT_SETTINGS,
    ControlPlaneClient,
    ControlPlaneError,
    check_transport,
)
from gpu_agent.foundations.http import ListenError
from gpu_agent.foundations.secrets import REDACTOR, Secret
from gpu_agent.foundations.threads import in_daemon_thread
from gpu_agent.foundations.version import VersionAction, version_info
from gpu_agent.mechanisms.inventory.nvml import NVMLSource, describe_events
from gpu_agent.mechanisms.inventory.select import GPU_SOURCE_SETTINGS, GPUSourceConfig, make_source
from gpu_agent.roles import chart_test, cluster_agent, local, node_agent, workload
from gpu_agent.roles.control_plane import main as control_plane

ROLES: dict[str, tuple[list[Setting], type[RoleConfig], str]] = {
    "local": (local.SETTINGS, local.LocalConfig, "control plane + cluster agent with fake GPUs on loopback"),
    "cluster-agent": (cluster_agent.SETTINGS, cluster_agent.ClusterAgentConfig, "the cluster agent"),
    "node-agent": (node_agent.SETTINGS, node_agent.NodeAgentConfig, "the node agent"),
    "control-plane": (control_plane.SETTINGS, control_plane.ControlPlaneConfig, "the reference control plane"),
}


QUEUE_SETTINGS = [
    *LOGGING,
    *TRANSPORT_SETTINGS,
    Setting("adminToken", "secret", "", "the control plane's admin token (env only; or adminTokenFile)"),
    Setting("adminTokenFile", "path", ".run/admin-token", "file holding the admin token (`make run` writes it there)",
            optional=True),
]


class QueueConfig(RoleConfig):
    """`gpu-agent queue`'s settings."""
    controlPlaneUrl: str
    controlPlaneCaFile: str
    controlPlaneAllowInsecure: bool
    adminToken: Secret
    adminTokenFile: str


class InventoryConfig(GPUSourceConfig, RoleConfig):
    """`gpu-agent inventory`'s settings."""


# The process's exit codes: what `gpu-agent --help` prints and docs/cli.md's table says (a unit test holds the
# three together, and one test per code makes a real process exit with it).
EXIT_CODES: dict[int, str] = {
    0: "success; also --help, --version, and a serving role (local, cluster-agent, node-agent, control-plane) "
       "stopped by SIGTERM or SIGINT",
    1: "the command ran and failed: `queue` could not reach the control plane or the control plane refused the call "
       "(the message says which); `inventory`'s GPU source answered with an error (the inventory is printed all "
       "the same, its error set); a `chart-test` check failed (its line names it "
       "and the fix); a `workload` run FAILED (its last line says why); also an unexpected error, its traceback "
       "on stderr",
    2: "usage: an unknown command, flag or choice, a bad setting value (the message names the setting and where it "
       "came from), no admin token for `queue`, a listen address that cannot be bound, a `workload` peer list that "
       "cannot be read or parsed",
    3: "`cluster-agent`, or `local` with --graceful-no-gpu=false, started with no GPUs and gracefulNoGPU is off "
       "(its last log line says why and what to set)",
    130: "interrupted (Ctrl-C) in a one-shot command such as `queue` or `inventory`, or before a serving role "
         "had started",
}
# The codes each command can exit with (every command: 0, and 2 for usage).
COMMAND_EXIT_CODES: dict[str, tuple[int, ...]] = {
    "local": (0, 2, 3, 130), "cluster-agent": (0, 2, 3, 130), "node-agent": (0, 2, 130), "control-plane": (0, 2, 130),
    "inventory": (0, 1, 2, 130), "queue": (0, 1, 2, 130), "queue list": (0, 1, 2, 130), "queue add": (0, 1, 2, 130),
    "chart-test": (0, 1, 2, 130), "workload": (0, 1, 2, 130), "completion": (0, 2), "version": (0, 2),
}
OUTPUTS = ("json", "yaml", "wide")
QUEUE_LIST_KIND = {"apiVersion": "gpu-agent/v1", "kind": "QueueList"}
ITEM_STATES = ("queued", "leased", "done", "failed")


def exit_codes_text(codes: tuple[int, ...] | None = None) -> str:
    """The exit-code table for an epilog: a header paragraph, then one row a code (wrapped by _Formatter)."""
    rows = [f"  {code:<5}{meaning}" for code, meaning in EXIT_CODES.items() if codes is None or code in codes]
    return "Exit codes:\n\n" + "\n".join(rows)


class _Formatter(argparse.HelpFormatter):
    """argparse's formatter, except that a paragraph whose lines are indented is a table: each of its lines is
    wrapped on its own, under its second column (argparse's would run the rows together)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = []
        for para in text.split("\n\n"):
            if not para.startswith(" "):
                paragraphs.append(super()._fill_text(para, width, indent))
                continue
            lines = []
            for line in para.splitlines():
                first = re.sub(r"^(\s*\S+\s+).*", r"\1", line) if re.match(r"\s*\S+\s+\S", line) else ""
                lines += textwrap.wrap(line[len(first):], width, initial_indent=indent + first, break_on_hyphens=False,
                                       subsequent_indent=indent + " " * len(first)) or [indent + first]
            paragraphs.append("\n".join(lines))
        return "\n\n".join(paragraphs)


def _command(sub: Any, name: str, help_text: str, path: str = "") -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(name, help=help_text, description=help_text,
                                                     formatter_class=_Formatter)
    parser.epilog = exit_codes_text(COMMAND_EXIT_CODES[f"{path} {name}".strip()])
    return parser


def _with_settings(parser: argparse.ArgumentParser, settings: list[Setting]) -> argparse.ArgumentParser:
    codes = parser.epilog
    add_arguments(parser, settings)  # sets the epilog when a setting is a secret (where secrets come from)
    if parser.epilog != codes:
        parser.epilog = f"{parser.epilog}\n\n{codes}"
    return parser


def _add_output(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("-o", "--output", choices=OUTPUTS, metavar="FORMAT",
                        help=f"json or yaml: one document of a fixed shape, for scripts; wide: a table with every "
                             f"column (default: {default})")


def _add_workload(sub: Any) -> None:
    work = _command(sub, "workload", "a multi-node workload of ours, one Pod per node of a GPUDomain (an indexed "
                    "Job: e2e/manifests/domain-workload.yaml.j2), over TCP: each rank finds the others in the "
                    "domain's peer list; the last line says PASSED (exit 0) or FAILED and why (exit 1)")
    work.add_argument("pattern", choices=workload.PATTERNS, help="nickelpie: send/recv around the ring and a "
                      "broadcast from rank 0, each checksum verified; nvbandwidth: the bandwidth between every pair "
                      "of nodes (node/GPU pairs with --gpus-per-node), printed by rank 0 as a table")
    work.add_argument("--world", type=int, required=True, metavar="N", help="how many ranks (Pods, one per node): "
                      "the run starts once the peer list holds N Ready peers (default: none, required)")
    work.add_argument("--peers", metavar="PATH", help="the peer list (default: $GPU_AGENT_DOMAIN_PEERS, else "
                      f"{workload.DEFAULT_PEERS})")
    work.add_argument("--node-index", type=int, metavar="N", help="this node's index in the peer list "
                      "(default: $GPU_AGENT_DOMAIN_NODE_INDEX; where that is empty, --node-name finds it)")
    work.add_argument("--node-name", metavar="NAME", help="this node's name in the peer list, used while the "
                      "index is unknown (default: $NODE_NAME)")
    work.add_argument("--port", type=int, default=workload.DEFAULT_PORT, help="the TCP port every rank listens on, "
                      "on all addresses, and reaches the others at (default: %(default)s)")
    work.add_argument("--timeout", type=float, default=workload.DEFAULT_TIMEOUT, metavar="SECONDS", help="the "
                      "bound of the whole run: waiting for the peers, retries after a lost one included "
                      "(default: %(default)g)")
    work.add_argument("--bytes", type=int, default=workload.DEFAULT_BYTES, metavar="N", help="the payload of each "
                      "step, and of each bandwidth iteration (default: %(default)s, 1 MiB)")
    work.add_argument("--iterations", type=int, default=workload.DEFAULT_ITERATIONS, metavar="N",
                      help="nvbandwidth: the payloads sent per measured pair (default: %(default)s)")
    work.add_argument("--repeat", type=int, default=1, metavar="K", help="nickelpie: run the ring and the "
                      "broadcast K times, a run long enough to lose a Pod in the middle of (default: %(default)s)")
    work.add_argument("--interval", type=float, default=0.0, metavar="SECONDS", help="nickelpie: the pause between "
                      "two repeats (default: %(default)g)")
    work.add_argument("--gpus-per-node", type=int, metavar="K", help="nvbandwidth: the GPUs of each node, whose "
                      "node/GPU pairs are measured each on its own connection (default: the UUIDs in "
                      "$NVIDIA_VISIBLE_DEVICES, at least 1)")
    work.add_argument("--io-timeout", type=float, default=workload.DEFAULT_IO_TIMEOUT, metavar="SECONDS",
                      help="the bound of each socket operation (connect, send, receive) (default: %(default)g)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpu-agent", description="GPU agent for Kubernetes",
                                     epilog=exit_codes_text(), formatter_class=_Formatter)
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="role", required=True, metavar="ROLE")
    for name, (settings, _, help_text) in ROLES.items():
        _with_settings(_command(sub, name, help_text), settings)
    inventory = _with_settings(_command(sub, "inventory", "read the GPU source once and print the inventory "
                                        "(JSON unless -o says otherwise)"), [*LOGGING, *GPU_SOURCE_SETTINGS])
    _add_output(inventory, "json, as before -o existed")
    queue = _command(sub, "queue", "list or add work items at the control plane (admin token)")
    actions = queue.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = _with_settings(_command(actions, "list", "the newest 200 items with their state, and the queue's counts",
                                      "queue"), QUEUE_SETTINGS)
    _add_output(listing, "a table for people")
    add = _command(actions, "add", "enqueue one item (idempotent on its key)", "queue")
    add.add_argument("key", help="the item's idempotency key, e.g. demo-9 (adding the same key twice adds it once)")
    add.add_argument("--payload", default="{}", metavar="JSON", help="the item's payload, a JSON object (default: {})")
    _with_settings(add, QUEUE_SETTINGS)
    test = _command(sub, "chart-test", "what `helm test <release>` runs in the chart's test Pod: the control "
                    "plane's /healthz, the cluster agent's /livez and /healthz (why it is or is not Ready) and each node "
                    "agent's /livez, one line each; exit 1 naming what failed and the fix")
    test.add_argument("--namespace", default="default", help="the release's namespace (default: %(default)s)")
    test.add_argument("--fullname", default="gpu-agent", help="the prefix of the chart's object names, for the fixes "
                      "the lines name (default: %(default)s)")
    test.add_argument("--control-plane-url", default="", metavar="URL", help="the chart's own control plane: https://, "
                      "or http:// to a loopback host (else see --control-plane-allow-insecure); empty: not checked, as "
                      "where the chart runs none (default: empty)")
    test.add_argument("--control-plane-ca-file", default="", metavar="PATH", help="PEM bundle of the CA that signed "
                      "the control plane's certificate, which its /healthz and the work item's calls are verified "
                      "against; empty: the default trusted CAs (default: empty)")
    test.add_argument("--control-plane-allow-insecure", default="false", choices=("true", "false"), help="accept an "
                      "http:// --control-plane-url whose host is not loopback (the admin token then crosses the "
                      "network in clear; a warning says so) (default: %(default)s)")
    test.add_argument("--cluster-agent-url", default="http://127.0.0.1:8080", metavar="URL",
                      help="the cluster agent, where no --cluster-agent-service is named (default: %(default)s)")
    test.add_argument("--cluster-agent-service", default="", metavar="NAME", help="the cluster agents' Service, whose "
                      "EndpointSlices name each cluster agent, ready or not (a NotReady one is out of the Service); "
                      "empty: --cluster-agent-url is asked (default: empty)")
    test.add_argument("--node-agent-service", default="", metavar="NAME", help="the node agents' Service, whose "
                      "EndpointSlices name each node agent; empty: not checked (default: empty)")
    test.add_argument("--admin-token-file", default="", metavar="PATH", help="the control plane's admin token: one "
                      "work item is enqueued and must be done (with a cluster agent Ready); empty: no work item "
                      "(default: empty)")
    test.add_argument("--graceful-no-gpu", default="false", choices=("true", "false"), help="the release's "
                      "gracefulNoGPU: on, a cluster agent NotReady only for want of GPUs passes with a note "
                      "(default: %(default)s)")
    test.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS", help="the bound of the whole run "
                      "(default: %(default)s)")
    test.add_argument("--request-timeout", type=float, default=5.0, metavar="SECONDS", help="the bound of each HTTP "
                      "call (default: %(default)s)")
    test.add_argument("--kubeconfig", default="", metavar="PATH", help="the API server to list EndpointSlices at; "
                      "empty: in-cluster, then ~/.kube/config (default: empty)")
    _add_workload(sub)
    shells = _command(sub, "completion", "print a shell completion script for gpu-agent, made from this command's "
                      "own parser: `source <(gpu-agent completion bash)`; for zsh, after compinit, "
                      "`source <(gpu-agent completion zsh)`")
    shells.add_argument("shell", choices=("bash", "zsh"), help="the shell to complete in")
    _command(sub, "version", "print version, commit and build date as JSON")
    return parser


def _scrubbed(value: Any) -> Any:
    """`value` with every secret this process knows (the admin token) replaced by <redacted>, in every string:
    what the control plane sends back (an item's last error) is printed, and must not carry one."""
    if isinstance(value, str):
        return REDACTOR.scrub(value)
    if isinstance(value, dict):
        return {k: _scrubbed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrubbed(v) for v in value]
    return value


def _print_document(doc: Any, output: str) -> None:
    if output == "yaml":
        print(yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, allow_unicode=True), end="")
    else:
        print(json.dumps(doc, indent=2))


def _when(seconds: float | None) -> str:
    return "-" if seconds is None else datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def queue_list_document(items: list[dict[str, Any]], counts: dict[str, Any]) -> dict[str, Any]:
    """`gpu-agent queue list -o json|yaml`: every key always there (null when it has no value), in this order;
    its JSON Schema is gpu_agent/schemas/queue-list.schema.json."""
    return {**QUEUE_LIST_KIND,
            "items": [{"id": i.get("id"), "idempotencyKey": i.get("idempotencyKey"), "state": i.get("state"),
                       "deliveries": i.get("deliveries"), "failedAttempts": i.get("failedAttempts", 0),
                       "createdAt": i.get("createdAt"), "ackedAt": i.get("ackedAt"), "lastError": i.get("lastError")}
                      for i in items],
            "counts": {state: counts.get(state, 0) for state in ITEM_STATES}}


def _print_queue(items: list[dict[str, Any]], counts: dict[str, Any], output: str | None) -> None:
    if output in ("json", "yaml"):
        _print_document(queue_list_document(items, counts), output)
        return
    wide = output == "wide"
    print(f"{'ID':>6}  {'KEY':<32} {'STATE':<7} {'DELIVERIES':>10} {'FAILED':>6}  "
          + (f"{'CREATED':<20} {'ACKED':<20} " if wide else "") + "LAST ERROR")
    for i in items:
        error = " ".join(str(i.get("lastError") or "").split())  # one line per item
        print(f"{i.get('id', '?'):>6}  {i.get('idempotencyKey', '?')!s:<32} {i.get('state', '?')!s:<7} "
              f"{i.get('deliveries', '?'):>10} {i.get('failedAttempts', 0):>6}  "
              + (f"{_when(i.get('createdAt')):<20} {_when(i.get('ackedAt')):<20} {error}" if wide else error[:120]))
    print("counts: " + ", ".join(f"{k} {v}" for k, v in counts.items()))


def _check_transport(cfg: QueueConfig | cluster_agent.ClusterAgentConfig) -> None:
    """Hold the control plane's URL and CA file to the clients' one rule (a ConfigError: exit 2, the message naming
    the setting and the fix); plain HTTP it allows all the same is a warning, logged at every verbosity."""
    if insecure := check_transport(cfg.controlPlaneUrl, cfg.controlPlaneCaFile, cfg.controlPlaneAllowInsecure):
        klog.get_logger("gpu_agent.cli").warning("%s", insecure)


def _queue(args: argparse.Namespace, cfg: QueueConfig) -> int:
    _check_transport(cfg)
    if not cfg.adminToken:
        raise ConfigError("no admin token: set GPU_AGENT_ADMIN_TOKEN or --admin-token-file "
                          f"(`make run` writes it to .run/admin-token; tried {cfg.adminTokenFile or 'nothing'})")
    client = ControlPlaneClient(cfg.controlPlaneUrl, ca_file=cfg.controlPlaneCaFile)
    try:
        if args.action == "add":
            try:
                payload = json.loads(args.payload)
            except ValueError:
                payload = None
            if not isinstance(payload, dict):
                raise ConfigError(f"--payload must be a JSON object, e.g. '{{\"n\": 1}}'; got {args.payload!r}")
            item_id = client.enqueue(cfg.adminToken, args.key, payload)
            print(REDACTOR.scrub(f"item {args.key} queued (id {item_id})"))
            return 0
        items = _scrubbed(client.list_items(cfg.adminToken))
        counts = _scrubbed(client.status(cfg.adminToken).get("items", {}))
        _print_queue(items, counts, args.output)
        return 0
    except ControlPlaneError as e:
        print(REDACTOR.scrub(f"gpu-agent queue {args.action}: error: {e}"), file=sys.stderr)
        return 1
    finally:
        client.close()


async def _serve(cfg: Config) -> int:
    """Run the role whose settings `cfg` holds (the class says which); the process's exit code."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if isinstance(cfg, local.LocalConfig):  # before ClusterAgentConfig, which it extends
        return await local.run(cfg, stop)
    if isinstance(cfg, cluster_agent.ClusterAgentConfig):
        return await cluster_agent.ClusterAgent(cfg).run(stop)
    if isinstance(cfg, node_agent.NodeAgentConfig):
        await node_agent.NodeAgent(cfg).run(stop)
    else:
        assert isinstance(cfg, control_plane.ControlPlaneConfig)
        tls = control_plane.tls_files(cfg)
        server = control_plane.build_server(cfg, cfg.listenAddress, tls, cfg.tokenOverlap)
        server.start()
        klog.get_logger("gpu_agent.cli").info("reference control plane %s", control_plane.serving(server, tls))
        try:
            await stop.wait()
        finally:
            await in_daemon_thread(server.stop)
    return 0


def _print_inventory(cfg: InventoryConfig, output: str | None) -> int:
    """The inventory as JSON (the default, unchanged since before -o), YAML or a wide table; its JSON Schema is
    gpu_agent/schemas/inventory.schema.json. Exit code 1 when the source answered with an error."""
    source = make_source(cfg)
    reading = source.read()
    gpus = [{**g.to_json(), "health": g.health, **({"healthReason": g.health_reason} if g.health_reason else {})}
            for g in reading.inventory.gpus]
    doc = {"source": source.name, "count": reading.inventory.count, "gpus": gpus,
           "clique": reading.inventory.clique, "fabric": reading.inventory.fabric,
           "error": reading.error, "note": reading.note}
    if isinstance(source, NVMLSource):  # the health events each GPU supports and those the source registered
        doc["healthEvents"] = {uuid: {"supported": describe_events(mask),
                                      "registered": describe_events(source.registered_events.get(uuid, 0))}
                               for uuid, mask in source.supported_events.items()}
    source.close()
    if output == "wide":
        print(f"{'INDEX':>5}  {'UUID':<40} {'NAME':<24} {'MEMORY':>10} {'MIG':<5} {'HEALTH':<9} REASON")
        for g in gpus:
            print(f"{g['index']:>5}  {g['uuid']:<40} {g['name']:<24} {g['memoryTotalBytes'] // 2**20:>7}MiB "
                  f"{'on' if g['migMode'] else 'off':<5} {g['health']:<9} {g.get('healthReason', '')}".rstrip())
        print(f"source: {doc['source']}, count: {doc['count']}, clique: {doc['clique'] or '-'}, "
              f"fabric: {doc['fabric'] or '-'}" + "".join(f", {k}: {doc[k]}" for k in ("error", "note") if doc[k]))
    else:
        _print_document(doc, output or "json")
    return 1 if reading.error else 0


def _chart_test(args: argparse.Namespace) -> int:
    if args.timeout <= 0 or args.request_timeout <= 0:
        raise ConfigError(f"--timeout and --request-timeout must be above 0; got {args.timeout:g} and "
                          f"{args.request_timeout:g}")
    if args.control_plane_url and (insecure := check_transport(args.control_plane_url, args.control_plane_ca_file,
                                                                args.control_plane_allow_insecure == "true")):
        print(f"gpu-agent chart-test: warning: {insecure}", file=sys.stderr, flush=True)
    cfg = chart_test.ChartTestConfig(
        namespace=args.namespace, fullname=args.fullname, controlPlaneUrl=args.control_plane_url,
        clusterAgentUrl=args.cluster_agent_url, clusterAgentService=args.cluster_agent_service,
        adminTokenFile=args.admin_token_file, controlPlaneCaFile=args.control_plane_ca_file,
        nodeAgentService=args.node_agent_service,
        gracefulNoGPU=args.graceful_no_gpu == "true", timeout=args.timeout, requestTimeout=args.request_timeout)
    lister = None
    if cfg.nodeAgentService or cfg.clusterAgentService:
        from gpu_agent.foundations.kube import api_client  # the Kubernetes client, only where it is used (its RSS)
        lister = chart_test.endpoint_slices(api_client(args.kubeconfig, limit=None))
    return chart_test.ChartTest(cfg, SystemClock(), list_endpoints=lister,
                                out=lambda line: print(line, flush=True)).run()


def _workload(args: argparse.Namespace) -> int:
    cfg = workload.settings(args.pattern, world=args.world, env=os.environ, peers=args.peers,
                            node_index=args.node_index, node_name=args.node_name, port=args.port,
                            timeout=args.timeout, nbytes=args.bytes, iterations=args.iterations,
                            gpus_per_node=args.gpus_per_node, io_timeout=args.io_timeout, repeat=args.repeat,
                            interval=args.interval)
    return workload.run(cfg, out=lambda line: print(line, flush=True))


def dump_stacks_on_sigusr2() -> None:
    """`kill -USR2 <pid>` writes every thread's stack to stderr (the log) and the process goes on:
    the first thing to ask of an agent that looks stuck."""
    if hasattr(signal, "SIGUSR2"):
        faulthandler.register(signal.SIGUSR2, all_threads=True, chain=False)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    dump_stacks_on_sigusr2()
    if args.role == "version":
        print(json.dumps(version_info()))
        return 0
    if args.role == "completion":
        print(completion.bash(parser) if args.shell == "bash" else completion.zsh(parser), end="")
        return 0
    try:
        if args.role == "inventory":
            inventory = load([*LOGGING, *GPU_SOURCE_SETTINGS], args, as_=InventoryConfig)
            klog.setup(inventory.verbosity, log_format=inventory.logFormat)
            return _print_inventory(inventory, args.output)
        if args.role == "chart-test":
            return _chart_test(args)
        if args.role == "workload":
            return _workload(args)
        if args.role == "queue":
            queue = load(QUEUE_SETTINGS, args, as_=QueueConfig)
            klog.setup(queue.verbosity, log_format=queue.logFormat)
            return _queue(args, queue)
        settings, config_class, _ = ROLES[args.role]
        cfg = load(settings, args, as_=config_class)
        klog.setup(cfg.verbosity, log_format=cfg.logFormat)
        # Not local's: its agent is handed the URL of its own control plane, in the same process.
        if isinstance(cfg, cluster_agent.ClusterAgentConfig) and not isinstance(cfg, local.LocalConfig):
            _check_transport(cfg)
        return asyncio.run(_serve(cfg))
    except (ConfigError, ListenError) as e:
        print(f"gpu-agent {args.role}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def entry() -> NoReturn:
    """The `gpu-agent` command (and `python -m gpu_agent`): main's exit code, the process left at once after the
    flush. By then the run has stopped what it owns, but a daemon thread can still be inside a C call (a watch's
    SSL read, a blocking call whose coroutine was cancelled), and the interpreter's finalization around it
    aborted the process: a cluster agent leaving with code 3 (no GPUs, gracefulNoGPU off) ended with 134 or 139
    instead, 6 runs in 8 against the CI cluster. Nothing is finalized after the flush, so the code is the run's."""
    try:
        code = main()
    except SystemExit as e:  # argparse's --help (0) and usage errors (2)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
