#!/usr/bin/env python3
"""Three rules of the agents' runtime that a reader checks by eye, checked on the syntax tree (`make lint` runs it).

1. Every Kubernetes API call carries its own timeout. A call of the generated client (`read_namespaced_pod`,
   `patch_node`, `list_cluster_custom_object`, ...) names `_request_timeout=` (or passes `**kwargs` on, whose
   caller must). A hung call holds whatever waits on it: a lease, a leader's deadline, a shutdown.
2. One way off the event loop, one owner of long-lived threads (agent/gpu_agent/foundations/threads.py: the bounded
   `in_daemon_thread` and `Threads.start`). No `threading.Thread(...)`, `asyncio.to_thread(...)`,
   `loop.run_in_executor(...)` or `ThreadPoolExecutor(...)` elsewhere in the product code, but where ALLOWED says why.
3. A cancel is never dropped: no `asyncio.wait_for(...)`. In Python 3.11 it returns its awaitable's answer and drops a
   cancel that comes in the same turn of the loop; the leader elector renewed on through its agent's shutdown that way
   (the Lease kept for the kubelet's grace period, then left to expire). `async with asyncio.timeout(...)` keeps it.

Checked: agent/gpu_agent, fake-gpu/fake_gpu and hooks/gpu_agent_hooks (tests and benchmarks are not product code).

    .venv/bin/python scripts/check-runtime-rules.py [ROOT]     (ROOT: the repository; default: this script's)

Exit status 0 when the rules hold, else 1 with one line per place: file:line, what, the fix.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

PACKAGES = ("agent/gpu_agent", "fake-gpu/fake_gpu", "hooks/gpu_agent_hooks")
THREADS = "agent/gpu_agent/foundations/threads.py"  # the owner itself
# A generated client method: a verb, then a namespaced or cluster-scoped kind, or a cluster-scoped kind by name.
API_CALL = re.compile(r"^(create|read|patch|replace|delete|list|delete_collection)_("
                      r"namespaced_\w+|cluster_custom_object\w*|node(_status)?|namespace(_status)?|"
                      r"custom_resource_definition\w*|resource_slice|device_class|persistent_volume(_status)?|"
                      r"runtime_class|priority_class|storage_class|validating_admission_policy\w*|"
                      r"cluster_role(_binding)?|mutating_webhook_configuration|validating_webhook_configuration)$")
OFF_LOOP = {"Thread": "threading.Thread", "to_thread": "asyncio.to_thread", "run_in_executor": "run_in_executor",
            "ThreadPoolExecutor": "ThreadPoolExecutor"}
# (file, construct) -> why it may start threads of its own
ALLOWED = {
    ("agent/gpu_agent/mechanisms/dra/plugin.py", "ThreadPoolExecutor"):
        "grpc.server takes its worker pool as an executor; the pool is bounded (max_workers) and the server's stop "
        "ends it",
    ("fake-gpu/fake_gpu/plugin.py", "ThreadPoolExecutor"):
        "grpc.server takes its worker pool as an executor; the pool is bounded (max_workers) and the server's stop "
        "ends it",
    ("agent/gpu_agent/roles/workload.py", "Thread"):
        "the workload is a process of a work Pod, not an agent: its accept loop and one answer thread per peer "
        "connection (at most MAX_CONNECTIONS), every one joined on the way out; an answer's error ends its connection, "
        "and the asker retries",
    ("hooks/gpu_agent_hooks/cli.py", "Thread"):
        "a hook is a one-shot Job: each cleanup step runs on a daemon thread joined at its deadline, its outcome (or "
        "'gave up') reported; a step still hung is abandoned when the Job exits",
}


def product_files(root: Path) -> list[Path]:
    return sorted(f for package in PACKAGES for f in (root / package).rglob("*.py") if "_pb2" not in f.name)


def called_name(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return ""


def problems(root: Path) -> list[str]:
    found = []
    for path in product_files(root):
        rel = path.relative_to(root).as_posix()
        try:
            tree = ast.parse(path.read_text(), filename=rel)
        except SyntaxError as e:
            found.append(f"{rel}:{e.lineno}: does not parse ({e.msg})")
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = called_name(node)
            injected = isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) and \
                node.func.value.id == "self"  # self.read_node(...): a callable the owner was given, timeout and all
            if API_CALL.match(name) and not injected:
                keywords = {k.arg for k in node.keywords}
                if "_request_timeout" not in keywords and None not in keywords:  # None: **kwargs passed on
                    found.append(f"{rel}:{node.lineno}: {name}(...) has no _request_timeout: a hung API server holds "
                                 f"its caller; fix: pass _request_timeout=REQUEST_TIMEOUT (foundations/kube.py)")
            elif name == "wait_for" and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) \
                    and node.func.value.id == "asyncio":
                found.append(f"{rel}:{node.lineno}: asyncio.wait_for(...) drops a cancel that meets its answer in one "
                             f"turn (Python 3.11); fix: async with asyncio.timeout(SECONDS): await ...")
            elif name in OFF_LOOP and rel != THREADS and (rel, name) not in ALLOWED:
                found.append(f"{rel}:{node.lineno}: {OFF_LOOP[name]}(...) starts a thread nobody owns; fix: "
                             f"in_daemon_thread (a blocking call) or Threads.start / start_thread (a long-lived "
                             f"thread) from foundations/threads.py, or say why in ALLOWED of this script")
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent
    found = problems(root)
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} place(s) break the runtime's rules (scripts/check-runtime-rules.py)", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
