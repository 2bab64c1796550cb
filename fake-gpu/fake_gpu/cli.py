"""`fake-gpu`: make fake GPUs arrive and leave at runtime.

    fake-gpu set --count 4 [--product NAME] [--memory-mib N]
    fake-gpu cycle --from 0 --to 4 --times 3 [--interval 2]
    fake-gpu status

The state file is `--state-file`, else $FAKE_GPU_STATE_FILE, else .run/fake-gpus.json.
Bad input is refused with a message and changes nothing (exit code 2).
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import sys
import time
from pathlib import Path

from fake_gpu.layout import DEFAULT_MEMORY_MIB, DEFAULT_PRODUCT, MAX_GPUS, LayoutError, build
from gpu_agent.foundations import fake_state
from gpu_agent.foundations.gpus import Inventory


def _current(path: Path) -> Inventory:
    try:
        return fake_state.read(path)
    except fake_state.FakeStateError:
        return Inventory()  # a missing or broken file is replaced whole by `set`


def _set(path: Path, count: int, product: str, memory_mib: int, max_gpus: int, node: str) -> Inventory:
    inventory = build(_current(path), count, product, memory_mib, random.Random(), max_gpus)
    fake_state.write_atomic(path, fake_state.render(inventory, node=node))
    return inventory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fake-gpu", description="fake GPUs that arrive and leave at runtime")
    parser.add_argument("--state-file", type=Path, default=None, help="state file (default: $FAKE_GPU_STATE_FILE or .run/fake-gpus.json)")
    sub = parser.add_subparsers(dest="command", required=True)
    p_set = sub.add_parser("set", help="set the number of fake GPUs")
    p_cycle = sub.add_parser("cycle", help="go back and forth between two counts")
    for p in (p_set, p_cycle):
        p.add_argument("--product", default=DEFAULT_PRODUCT, help=f"product name (default {DEFAULT_PRODUCT!r})")
        p.add_argument("--memory-mib", type=int, default=DEFAULT_MEMORY_MIB, help="memory per GPU in MiB")
        p.add_argument("--max", type=int, default=MAX_GPUS, dest="max_gpus", help=f"largest count accepted (default {MAX_GPUS})")
        p.add_argument("--node", default=socket.gethostname(), help="node name recorded in the file")
    p_set.add_argument("--count", type=int, required=True, help="number of GPUs, 0 or more")
    p_cycle.add_argument("--from", type=int, dest="low", default=0)
    p_cycle.add_argument("--to", type=int, dest="high", default=4)
    p_cycle.add_argument("--times", type=int, default=3)
    p_cycle.add_argument("--interval", type=float, default=2.0, help="seconds between changes")
    sub.add_parser("status", help="print the current fake GPUs as JSON")
    args = parser.parse_args(argv)
    path = args.state_file or fake_state.default_path()
    try:
        if args.command == "status":
            inventory = fake_state.read(path)
            print(json.dumps({"stateFile": str(path), "count": inventory.count, "gpus": inventory.to_json()}, indent=2))
        elif args.command == "set":
            inventory = _set(path, args.count, args.product, args.memory_mib, args.max_gpus, args.node)
            print(f"{path}: {inventory.count} fake GPUs")
        else:
            if args.times < 1 or args.interval < 0:
                raise LayoutError("--times must be 1 or more and --interval 0 or more")
            for k in range(args.times):
                for count in (args.high, args.low):
                    inventory = _set(path, count, args.product, args.memory_mib, args.max_gpus, args.node)
                    print(f"cycle {k + 1}/{args.times}: {inventory.count} fake GPUs", flush=True)
                    time.sleep(args.interval)
    except (LayoutError, fake_state.FakeStateError) as e:
        print(f"fake-gpu: error: {e}", file=sys.stderr)
        return 2
    return 0
