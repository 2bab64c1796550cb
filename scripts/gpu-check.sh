#!/usr/bin/env bash
# On a machine with a real NVIDIA GPU: the agent's NVML inventory against `nvidia-smi -L`, each GPU's
# health and supported event types, a 3 s wait on the NVML event set (no error, prompt close), then the
# cluster agent (embedded control plane, gpuSource=nvml) and its /healthz.
# Needs python3 with nvidia-ml-py, prometheus-client, requests, PyYAML and jinja2.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/agent:$PWD/fake-gpu PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
state=$(mktemp -d)
# curl may be missing where this runs: fetch with Python. Prints the status, writes the body to $2.
get() { $py -c 'import sys,urllib.request,urllib.error
try: r=urllib.request.urlopen(sys.argv[1],timeout=2); code,body=r.status,r.read()
except urllib.error.HTTPError as e: code,body=e.code,e.read()
except OSError: code,body=0,b""
open(sys.argv[2],"wb").write(body); print(code)' "$1" "${2:-/dev/null}"; }
echo "== nvidia-smi -L"; nvidia-smi -L
echo "== gpu-agent inventory --gpu-source nvml"
$py -m gpu_agent inventory --gpu-source nvml | tee "$state/inventory.json"
echo "== compare UUIDs"
$py - "$state/inventory.json" <<'PY'
import json, re, subprocess, sys
inv = json.load(open(sys.argv[1]))
smi = re.findall(r"UUID: (GPU-[0-9a-f-]+)", subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout)
ours = [g["uuid"] for g in inv["gpus"]]
print(f"nvidia-smi: {len(smi)} GPUs; agent: {inv['count']} GPUs")
for g in inv["gpus"]:
    print(f"  {g['index']}: {g['uuid']} {g['name']} {g['memoryTotalBytes'] / 2**30:.1f} GiB migMode={g['migMode']}")
print("UUIDs MATCH" if sorted(smi) == sorted(ours) else f"UUIDs DIFFER: smi={smi} agent={ours}")
print(f"NVLink fabric: {inv.get('fabric') or '(not read)'}; clique: {inv.get('clique') or '(none)'}")
for g in inv["gpus"]:
    events = inv.get("healthEvents", {}).get(g["uuid"], {})
    print(f"  {g['index']}: health {g.get('health')}" + (f" ({g['healthReason']})" if g.get("healthReason") else "")
          + f"; event types supported: {events.get('supported', '?')}; registered: {events.get('registered', '?')}")
PY
echo "== NVML health events: wait on the event set for 3 s"
$py - <<'PY'
import time
from gpu_agent.mechanisms.inventory.nvml import NVMLSource, describe_events
src = NVMLSource()
r = src.read()
if r.error:
    raise SystemExit(f"EVENTS FAILED: reading GPUs: {r.error}")
registered = dict(src.registered_events)
for g in r.inventory.gpus:
    print(f"  {g.index}: {g.uuid} {g.health}{' (' + g.health_reason + ')' if g.health_reason else ''}; "
          f"registered for: {describe_events(registered.get(g.uuid, 0))}")
time.sleep(3)
events = src.events
waits, delivered, errors = (events.waits, events.delivered, list(events.errors)) if events else (0, 0, [])
started = time.monotonic()
src.close()
closed = time.monotonic() - started
print(f"3 s on the event set: {waits} waits ended, {delivered} events, errors: {errors or 'none'}; close took {closed:.2f}s")
ok = not errors and closed < 2 and (waits >= 3 or not registered)
print("EVENTS OK" if ok else "EVENTS FAILED")
PY
echo "== cluster agent with NVML"
$py -m gpu_agent local --gpu-source nvml --state-dir "$state" --executor-journal "$state/exec.sqlite" \
  --database "$state/cp.sqlite" --listen-address 127.0.0.1:18080 --control-plane-listen 127.0.0.1:18700 -v 2 \
  > "$state/agent.log" 2>&1 &
pid=$!
code=000
for _ in $(seq 1 60); do
  code=$(get http://127.0.0.1:18080/healthz "$state/healthz.json")
  [[ $code == 200 ]] && break
  sleep 0.25
done
echo "/healthz -> $code"; cat "$state/healthz.json"; echo
echo "/livez -> $(get http://127.0.0.1:18080/livez)"
get http://127.0.0.1:18080/metrics "$state/metrics.txt" >/dev/null; grep -E '^gpu_agent_(gpus|gpus_by_health|gpu_health_transitions_total|ready|queue_paused|items_processed_total)' "$state/metrics.txt"
kill "$pid"; wait "$pid"
echo "== agent log"; cut -c1-200 "$state/agent.log"
