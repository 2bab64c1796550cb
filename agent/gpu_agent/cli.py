"""`gpu-agent`: one command, one subcommand per role.

    gpu-agent local           control plane + cluster agent + fake GPUs on loopback (the main job)
    gpu-agent cluster-agent   the cluster agent alone
    gpu-agent node-agent      the node agent (one per GPU node)
    gpu-agent control-plane   the reference control plane alone
    gpu-agent inventory       read the GPU source once and print the inventory as JSON
    gpu-agent queue list|add  the control plane's work queue (admin token), e.g. beside `make run`
    gpu-agent version         (or `gpu-agent --version`)

Bad flags and bad values exit with code 2 and a message naming the setting. A cluster agent (or
`local` with --graceful-no-gpu=false) that starts with no GPUs and gracefulNoGPU off exits with code 3,
its last log line saying why (roles/cluster_agent.py).
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import logging
import os
import signal
import sys
from typing import NoReturn

from gpu_agent.foundations import klog
from gpu_agent.foundations.config import VERBOSITY, Config, ConfigError, RoleConfig, Setting, add_arguments, load
from gpu_agent.foundations.control_plane_client import ControlPlaneClient, ControlPlaneError
from gpu_agent.foundations.http import ListenError
from gpu_agent.foundations.secrets import Secret
from gpu_agent.foundations.threads import in_daemon_thread
from gpu_agent.foundations.version import VersionAction, version_info
from gpu_agent.mechanisms.inventory.nvml import NVMLSource, describe_events
from gpu_agent.mechanisms.inventory.select import GPU_SOURCE_SETTINGS, GPUSourceConfig, make_source
from gpu_agent.roles import cluster_agent, local, node_agent
from gpu_agent.roles.control_plane import main as control_plane

ROLES: dict[str, tuple[list[Setting], type[RoleConfig], str]] = {
    "local": (local.SETTINGS, local.LocalConfig, "control plane + cluster agent with fake GPUs on loopback"),
    "cluster-agent": (cluster_agent.SETTINGS, cluster_agent.ClusterAgentConfig, "the cluster agent"),
    "node-agent": (node_agent.SETTINGS, node_agent.NodeAgentConfig, "the node agent"),
    "control-plane": (control_plane.SETTINGS, control_plane.ControlPlaneConfig, "the reference control plane"),
}


QUEUE_SETTINGS = [
    VERBOSITY,
    Setting("controlPlaneUrl", "url", "http://127.0.0.1:8700", "control plane base URL"),
    Setting("adminToken", "secret", "", "the control plane's admin token (env only; or adminTokenFile)"),
    Setting("adminTokenFile", "path", ".run/admin-token", "file holding the admin token (`make run` writes it there)",
            optional=True),
]


class QueueConfig(RoleConfig):
    """`gpu-agent queue`'s settings."""
    controlPlaneUrl: str
    adminToken: Secret
    adminTokenFile: str


class InventoryConfig(GPUSourceConfig, RoleConfig):
    """`gpu-agent inventory`'s settings."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpu-agent", description="GPU agent for Kubernetes")
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="role", required=True, metavar="ROLE")
    for name, (settings, _, help_text) in ROLES.items():
        add_arguments(sub.add_parser(name, help=help_text, description=help_text), settings)
    add_arguments(sub.add_parser("inventory", help="read the GPU source once and print the inventory as JSON",
                                 description="read the GPU source once and print the inventory as JSON"),
                  [VERBOSITY, *GPU_SOURCE_SETTINGS])
    queue = sub.add_parser("queue", help="list or add work items at the control plane (admin token)",
                           description="list or add work items at the control plane (admin token)")
    actions = queue.add_subparsers(dest="action", required=True, metavar="ACTION")
    add_arguments(actions.add_parser("list", help="the newest 200 items with their state, and the queue's counts",
                                     description="the newest 200 items with their state, and the queue's counts"),
                  QUEUE_SETTINGS)
    add = actions.add_parser("add", help="enqueue one item (idempotent on its key)",
                             description="enqueue one item (idempotent on its key)")
    add.add_argument("key", help="the item's idempotency key, e.g. demo-9 (adding the same key twice adds it once)")
    add.add_argument("--payload", default="{}", metavar="JSON", help="the item's payload, a JSON object (default: {})")
    add_arguments(add, QUEUE_SETTINGS)
    sub.add_parser("version", help="print version, commit and build date as JSON",
                   description="print version, commit and build date as JSON")
    return parser


def _queue(args: argparse.Namespace, cfg: QueueConfig) -> int:
    if not cfg.adminToken:
        raise ConfigError("no admin token: set GPU_AGENT_ADMIN_TOKEN or --admin-token-file "
                          f"(`make run` writes it to .run/admin-token; tried {cfg.adminTokenFile or 'nothing'})")
    client = ControlPlaneClient(cfg.controlPlaneUrl)
    try:
        if args.action == "add":
            try:
                payload = json.loads(args.payload)
            except ValueError:
                payload = None
            if not isinstance(payload, dict):
                raise ConfigError(f"--payload must be a JSON object, e.g. '{{\"n\": 1}}'; got {args.payload!r}")
            item_id = client.enqueue(cfg.adminToken, args.key, payload)
            print(f"item {args.key} queued (id {item_id})")
            return 0
        items = client.list_items(cfg.adminToken)
        counts = client.status(cfg.adminToken).get("items", {})
        print(f"{'ID':>6}  {'KEY':<32} {'STATE':<7} {'DELIVERIES':>10} {'FAILED':>6}  LAST ERROR")
        for i in items:
            error = " ".join(str(i.get("lastError") or "").split())  # one line per item
            print(f"{i.get('id', '?'):>6}  {i.get('idempotencyKey', '?')!s:<32} {i.get('state', '?')!s:<7} "
                  f"{i.get('deliveries', '?'):>10} {i.get('failedAttempts', 0):>6}  {error[:120]}")
        print("counts: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
        return 0
    except ControlPlaneError as e:
        print(f"gpu-agent queue {args.action}: error: {e}", file=sys.stderr)
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
        server = control_plane.build_server(cfg, cfg.listenAddress)
        server.start()
        klog.get_logger("gpu_agent.cli").info("reference control plane listening on %s", server.url)
        try:
            await stop.wait()
        finally:
            await in_daemon_thread(server.stop)
    return 0


def _print_inventory(cfg: InventoryConfig) -> int:
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
    print(json.dumps(doc, indent=2))
    return 1 if reading.error else 0


def dump_stacks_on_sigusr2() -> None:
    """`kill -USR2 <pid>` writes every thread's stack to stderr (the log) and the process goes on:
    the first thing to ask of an agent that looks stuck."""
    if hasattr(signal, "SIGUSR2"):
        faulthandler.register(signal.SIGUSR2, all_threads=True, chain=False)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    dump_stacks_on_sigusr2()
    if args.role == "version":
        print(json.dumps(version_info()))
        return 0
    try:
        if args.role == "inventory":
            inventory = load([VERBOSITY, *GPU_SOURCE_SETTINGS], args, as_=InventoryConfig)
            klog.setup(inventory.verbosity)
            return _print_inventory(inventory)
        if args.role == "queue":
            queue = load(QUEUE_SETTINGS, args, as_=QueueConfig)
            klog.setup(queue.verbosity)
            return _queue(args, queue)
        settings, config_class, _ = ROLES[args.role]
        cfg = load(settings, args, as_=config_class)
        klog.setup(cfg.verbosity)
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
