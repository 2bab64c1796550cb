"""scripts/check-runtime-rules.py (`make lint`): every Kubernetes API call of the product code names its timeout,
and no thread starts outside foundations/threads.py but where the script says why. Checked on small trees written
here, and on the repository itself."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("check_runtime_rules", ROOT / "scripts" / "check-runtime-rules.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


rules = _load()


def tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for package in rules.PACKAGES:
        (tmp_path / package).mkdir(parents=True, exist_ok=True)
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_an_api_call_without_its_timeout_is_named_and_one_with_it_or_passing_kwargs_on_is_not(tmp_path):
    root = tree(tmp_path, {"agent/gpu_agent/a.py": (
        "def f(core, custom, kw):\n"
        "    core.read_namespaced_pod('p', 'ns')\n"                       # 2: no timeout
        "    core.patch_node('n', {},\n        _request_timeout=5)\n"     # the timeout on the next line: fine
        "    custom.list_cluster_custom_object('g', 'v', 'p', **kw)\n"    # passed on: its caller's to give
        "    core.list_node()\n"                                          # 6: no timeout
        "    path.read_text()\n"),                                        # not an API call
        "hooks/gpu_agent_hooks/b.py": "class C:\n    def g(self):\n        self.read_node('n')\n"})  # injected callable
    found = rules.problems(root)
    assert [line.split(": ")[0] for line in found] == ["agent/gpu_agent/a.py:2", "agent/gpu_agent/a.py:6"], found
    assert "read_namespaced_pod(...) has no _request_timeout" in found[0] and "REQUEST_TIMEOUT" in found[0]


def test_a_thread_started_outside_the_owner_is_named_unless_the_script_says_why(tmp_path):
    root = tree(tmp_path, {
        "agent/gpu_agent/foundations/threads.py": "import threading\nthreading.Thread(target=print)\n",
        "fake-gpu/fake_gpu/c.py": "import asyncio, threading\nthreading.Thread(target=print)\nasyncio.to_thread(print)\n",
        "agent/gpu_agent/mechanisms/dra/plugin.py": "from concurrent import futures\nfutures.ThreadPoolExecutor(2)\n",
        "hooks/gpu_agent_hooks/d.py": "def f(loop):\n    loop.run_in_executor(None, print)\n"})
    found = rules.problems(root)
    assert sorted(line.split(": ")[0] for line in found) == ["fake-gpu/fake_gpu/c.py:2", "fake-gpu/fake_gpu/c.py:3",
                                                             "hooks/gpu_agent_hooks/d.py:2"], found
    assert all("starts a thread nobody owns" in line and "in_daemon_thread" in line for line in found)


def test_the_repository_keeps_both_rules_and_every_allowed_place_exists_and_says_why():
    assert rules.problems(ROOT) == []
    for (rel, construct), why in rules.ALLOWED.items():
        assert construct in rules.OFF_LOOP and len(why) > 40
        assert construct in (ROOT / rel).read_text(), f"{rel} no longer uses {construct}: drop it from ALLOWED"
    assert rules.main(["check", str(ROOT)]) == 0


def test_asyncio_wait_for_is_named_and_asyncio_timeout_is_not(tmp_path):
    root = tree(tmp_path, {"agent/gpu_agent/a.py": (
        "import asyncio\n"
        "async def f(call):\n"
        "    return await asyncio.wait_for(call(), timeout=2)\n"         # 3: drops a cancel that meets its answer
        "async def g(call, condition):\n"
        "    async with asyncio.timeout(2):\n"
        "        await condition.wait_for(lambda: True)\n"              # a Condition's wait_for: not asyncio's
        "        return await call()\n")})
    found = rules.problems(root)
    assert [line.split(": ")[0] for line in found] == ["agent/gpu_agent/a.py:3"], found
    assert "asyncio.timeout" in found[0]
