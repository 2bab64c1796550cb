"""`python -m tests.sim` (PYTHONPATH=agent): run seeds, print a table; a failing seed prints its trace
and the command that replays it. Exit status 1 when any seed broke an invariant."""

from __future__ import annotations

import argparse
import sys
import time

from tests.sim.scenario import run_seed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make sim", description=__doc__)
    p.add_argument("--seeds", type=int, default=500, help="how many seeds to run (from --first)")
    p.add_argument("--first", type=int, default=1, help="the first seed")
    p.add_argument("--seed", type=int, help="replay this one seed and print its whole trace")
    p.add_argument("--no-fencing", action="store_true", help="the API server without the admission policy that "
                   "fences work Pods (shows that the exactly-once invariant then fails)")
    p.add_argument("--stop-after", type=int, default=3, help="stop after this many failing seeds")
    p.add_argument("--progress", type=int, default=0, help="print a line every this many seeds (0: never)")
    args = p.parse_args(argv)
    if args.seed is not None:
        out = run_seed(args.seed, fencing=not args.no_fencing, verbose=True)
        for t, line in out.trace:
            print(f"{t:9.3f}  {line}")
        print(f"seed {args.seed}: {'ok' if out.ok else 'FAILED'}; {out.items} items ({out.poison} poison), "
              f"max in flight {out.max_in_flight} (most seen {out.most_in_flight}), "
              f"{out.pods_created} pods created, {out.refused_creates} creates fenced, faults {out.faults}")
        for v in out.violations:
            print("  violation:", v)
        return 0 if out.ok else 1
    started, failed, totals = time.monotonic(), [], {"items": 0, "pods": 0, "fenced": 0, "virtual": 0.0}
    side_by_side = 0  # seeds in which an agent had more than one item in flight at once
    faults: dict[str, int] = {}
    for seed in range(args.first, args.first + args.seeds):
        out = run_seed(seed, fencing=not args.no_fencing)
        totals["items"] += out.items
        totals["pods"] += out.pods_created
        totals["fenced"] += out.refused_creates
        totals["virtual"] += out.virtual_seconds
        side_by_side += out.most_in_flight > 1
        for k, v in out.faults.items():
            faults[k] = faults.get(k, 0) + v
        done = seed - args.first + 1
        if args.progress and done % args.progress == 0:
            print(f"{done} seeds ({time.monotonic() - started:.0f}s), {len(failed)} failing", flush=True)
        if not out.ok:
            failed.append(seed)
            print(f"seed {seed} FAILED:")
            for v in out.violations:
                print("  ", v)
            print(f"   replay: make sim SEED={seed}{' ARGS=--no-fencing' if args.no_fencing else ''}")
            if len(failed) >= args.stop_after:
                break
    ran = seed - args.first + 1
    took = time.monotonic() - started
    print(f"{ran} seeds in {took:.1f}s ({ran / took:.0f}/s): {totals['items']} items, {totals['pods']} pods created, "
          f"{totals['fenced']} creates fenced, {totals['virtual'] / 3600:.1f} h of virtual time, {side_by_side} seed(s) "
          f"with items side by side; faults {faults}; "
          f"{len(failed)} failing seed(s){': ' + ' '.join(map(str, failed)) if failed else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
