"""`gpu-agent`: one command, one subcommand per role.

    gpu-agent local           control plane + cluster agent + fake GPUs on loopback (the main job)
    gpu-agent cluster-agent   the cluster agent alone
    gpu-agent node-agent      the node agent (one per GPU node)
    gpu-agent control-plane   the reference control plane alone
    gpu-agent inventory       read the GPU source once and print the inventory as JSON
    gpu-agent version

Bad flags and bad values exit with code 2 and a message naming the setting.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

from gpu_agent.foundations import klog
from gpu_agent.foundations.config import VERBOSITY, ConfigError, Setting, add_arguments, load
from gpu_agent.foundations.version import version_info
from gpu_agent.mechanisms.inventory.select import GPU_SOURCE_SETTINGS, make_source
from gpu_agent.roles import cluster_agent, local, node_agent
from gpu_agent.roles.control_plane import main as control_plane

ROLES: dict[str, tuple[list[Setting], str]] = {
    "local": (local.SETTINGS, "control plane + cluster agent with fake GPUs on loopback"),
    "cluster-agent": (cluster_agent.SETTINGS, "the cluster agent"),
    "node-agent": (node_agent.SETTINGS, "the node agent"),
    "control-plane": (control_plane.SETTINGS, "the reference control plane"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpu-agent", description="GPU agent for Kubernetes")
    sub = parser.add_subparsers(dest="role", required=True, metavar="ROLE")
    for name, (settings, help_text) in ROLES.items():
        add_arguments(sub.add_parser(name, help=help_text, description=help_text), settings)
    add_arguments(sub.add_parser("inventory", help="read the GPU source once and print the inventory as JSON"),
                  [VERBOSITY, *GPU_SOURCE_SETTINGS])
    sub.add_parser("version", help="print version, commit and build date")
    return parser


async def _serve(role: str, cfg) -> None:  # type: ignore[no-untyped-def]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if role == "local":
        await local.run(cfg, stop)
    elif role == "cluster-agent":
        await cluster_agent.ClusterAgent(cfg).run(stop)
    elif role == "node-agent":
        await node_agent.NodeAgent(cfg).run(stop)
    else:
        server = control_plane.build_server(cfg, cfg.listenAddress)
        server.start()
        klog.get_logger("gpu_agent.cli").info("reference control plane listening on %s", server.url)
        try:
            await stop.wait()
        finally:
            await asyncio.to_thread(server.stop)


def _print_inventory(cfg) -> int:  # type: ignore[no-untyped-def]
    source = make_source(cfg)
    reading = source.read()
    doc = {"source": source.name, "count": reading.inventory.count, "gpus": reading.inventory.to_json(),
           "error": reading.error, "note": reading.note}
    source.close()
    print(json.dumps(doc, indent=2))
    return 1 if reading.error else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.role == "version":
        print(json.dumps(version_info()))
        return 0
    settings = ROLES[args.role][0] if args.role in ROLES else [VERBOSITY, *GPU_SOURCE_SETTINGS]
    try:
        cfg = load(settings, args)
        klog.setup(cfg.verbosity)
        if args.role == "inventory":
            return _print_inventory(cfg)
        asyncio.run(_serve(args.role, cfg))
    except ConfigError as e:
        print(f"gpu-agent {args.role}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
