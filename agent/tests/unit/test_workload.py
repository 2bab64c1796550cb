"""`gpu-agent workload` (roles/workload.py): ranks on loopback, each a `Rank` on a thread with its own listener
(127.0.0.1, a port of its own, named in the peer list as `127.0.0.1:<port>`) and its own copy of the peer list in
a tmp dir, as each Pod reads its own mounted one; two tests run the real command in subprocesses. The waits that
end at a deadline run on a clock the test moves (`FakeClock`), or on short real deadlines where sockets decide."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import jinja2
import pytest
import yaml

from gpu_agent.roles import workload
from gpu_agent.roles.workload import Rank, WorkloadConfig, WorkloadError

REPO = Path(__file__).resolve().parents[3]
AGENT = Path(workload.__file__).resolve().parents[2]  # the folder holding gpu_agent
JOIN = 30.0  # a bound on each rank's thread; a passing run takes well under a second


class FakeClock:
    """monotonic() and sleep() for a wait that only polls a file: sleeping moves the time, at once."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def write_atomic(path: Path, text: str) -> None:
    """As the node agent replaces the peer list: a new file renamed over the old."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Ranks:
    """N ranks of one run on loopback, a peer-list file each."""

    def __init__(self, tmp_path: Path, n: int, pattern: str = "nickelpie", **cfg: object) -> None:
        self.tmp, self.n, self.pattern, self.cfg = tmp_path, n, pattern, cfg
        self.listeners = {i: socket.create_server(("127.0.0.1", 0)) for i in range(n)}
        self.ports = {i: s.getsockname()[1] for i, s in self.listeners.items()}
        self.lines: dict[int, list[str]] = {i: [] for i in range(n)}
        self.codes: dict[int, int | BaseException] = {}
        self.threads: dict[int, threading.Thread] = {}
        self.ranks: dict[int, Rank] = {}
        self.write()

    def peers_text(self) -> str:
        return (f"# GPUDomain default/test: {self.n} node(s), sorted by index\n"
                + "".join(f"{i} node-{i} 127.0.0.1:{self.ports[i]} Ready\n" for i in range(self.n)))

    def write(self, text: str | None = None) -> None:
        for i in range(self.n):
            write_atomic(self.tmp / f"peers-{i}", text or self.peers_text())

    def config(self, i: int, **over: object) -> WorkloadConfig:
        values = {"world": self.n, "peers": str(self.tmp / f"peers-{i}"), "node_index": i, "timeout": 20.0,
                  "nbytes": 1 << 16, "io_timeout": 5.0, "poll": 0.02, "report_every": 1.0, **self.cfg, **over}
        return WorkloadConfig(self.pattern, **values)  # type: ignore[arg-type]

    def start(self, i: int, config: dict[str, object] | None = None, **kw: object) -> Rank:
        rank = Rank(self.config(i, **(config or {})), listener=self.listeners[i], out=self.lines[i].append, **kw)  # type: ignore[arg-type]
        self.ranks[i] = rank

        def go() -> None:
            try:
                self.codes[i] = rank.run()
            except BaseException as e:  # noqa: BLE001 - a killed rank ends by Killed; the test looks at it
                self.codes[i] = e

        self.threads[i] = threading.Thread(target=go, daemon=True)
        self.threads[i].start()
        return rank

    def join(self, *which: int) -> dict[int, int | BaseException]:
        for i in which or range(self.n):
            self.threads[i].join(JOIN)
            assert not self.threads[i].is_alive(), f"rank {i} still runs:\n" + "\n".join(self.lines[i])
        return self.codes

    def run_all(self) -> dict[int, int | BaseException]:
        for i in range(self.n):
            self.start(i)
        return self.join()

    def text(self, i: int) -> str:
        return "\n".join(self.lines[i])


@pytest.mark.parametrize("n", [2, 3])
def test_nickelpie_passes_and_each_rank_names_the_peers_it_saw_in_its_list(tmp_path: Path, n: int) -> None:
    ranks = Ranks(tmp_path, n)
    codes = ranks.run_all()
    assert codes == dict.fromkeys(range(n), 0), {i: ranks.text(i) for i in range(n)}
    for i in range(n):
        text = ranks.text(i)
        # the peers it saw, names and ips, read from its own file
        seen = re.search(rf"peer list .*peers-{i}: {n} node\(s\): (.*)", text)
        assert seen, text
        for j in range(n):
            assert f"{j} node-{j} 127.0.0.1:{ranks.ports[j]} Ready" in seen.group(1)
        assert f"this is rank {i} on node-{i}" in text
        src = (i - 1) % n
        assert re.search(rf"step 1/2 sendrecv .* {src} -> {i}: recv 65536 bytes from rank {src} .* ok", text), text
        assert re.search(rf"step 1/2 sendrecv .* {i} -> {(i + 1) % n}: send 65536 bytes to rank {(i + 1) % n} "
                         r".*checksum verified by the receiver", text), text
        if i:
            assert re.search(rf"step 2/2 broadcast from rank 0 -> {i}: recv 65536 bytes .* ok", text), text
        assert ranks.lines[i][-1].startswith(f"[rank {i}/{n}] PASSED nickelpie: {n} ranks"), text
    assert len(re.findall(r"broadcast from rank 0 -> \d: send", ranks.text(0))) == n - 1


def test_nvbandwidth_prints_a_complete_table_of_2_nodes_by_2_gpus(tmp_path: Path) -> None:
    ranks = Ranks(tmp_path, 2, "nvbandwidth", gpus_per_node=2, iterations=2)
    codes = ranks.run_all()
    assert codes == {0: 0, 1: 0}, {i: ranks.text(i) for i in range(2)}
    lines = [line.removeprefix("[rank 0/2] ") for line in ranks.lines[0]]
    head = lines.index("tcp node:gpu(row) -> node:gpu(column) bandwidth (GB/s)")
    labels = ["0:0", "0:1", "1:0", "1:1"]
    assert lines[head + 1].split() == labels
    for k, src in enumerate(labels):
        row = lines[head + 2 + k].split()
        assert row[0] == src and len(row) == 5, lines[head + 2 + k]
        for dst, cell in zip(labels, row[1:], strict=True):
            if src == dst:
                assert cell == "N/A"
            else:
                assert re.fullmatch(r"\d+\.\d\d", cell) and float(cell) > 0, (src, dst, cell)
    assert lines[head + 7].startswith("SUM tcp_node_gpu_to_node_gpu ")
    assert "PASSED nvbandwidth: the 4 x 4 table is complete (12 cells measured)" in ranks.lines[0][-1]
    # each rank measured the 6 cells into its own GPUs, each pair on its own connection
    assert len(re.findall(r"measured \d:\d -> 1:\d: [\d.]+ GB/s \(2 x 65536 bytes", ranks.text(1))) == 6
    assert ranks.lines[1][-1].startswith("[rank 1/2] PASSED nvbandwidth")


def test_nvbandwidth_fails_when_a_cell_of_the_table_is_missing(tmp_path: Path) -> None:
    class DropsACell(Rank):
        def _nvbandwidth(self, world):  # type: ignore[no-untyped-def]
            summary = super()._nvbandwidth(world)
            with self._lock:
                assert self._results is not None
                del self._results["0>1"]
            return summary

    ranks = Ranks(tmp_path, 2, "nvbandwidth", iterations=1)
    ranks.start(0)
    rank = DropsACell(ranks.config(1), listener=ranks.listeners[1], out=ranks.lines[1].append)
    ranks.threads[1] = threading.Thread(target=lambda: ranks.codes.__setitem__(1, rank.run()), daemon=True)
    ranks.threads[1].start()
    codes = ranks.join()
    assert codes[0] == 1, ranks.text(0)
    assert "FAILED nvbandwidth: the bandwidth table is incomplete: no value for 0 -> 1" in ranks.lines[0][-1]
    assert codes[1] == 1 and "rank 0 aborted the run: the bandwidth table is incomplete" in ranks.lines[1][-1]


def test_a_rank_killed_mid_run_is_waited_for_and_the_run_completes_once_it_is_back_at_a_new_address(
        tmp_path: Path) -> None:
    """Rank 1 dies while it serves rank 2 its step (a Pod force-deleted): rank 2's connection breaks, it re-reads
    its peer list and retries the round; rank 0 waits for rank 1 to be done. The replacement listens elsewhere (a
    new ip: here a new port), the lists are replaced, and all three pass."""
    ranks = Ranks(tmp_path, 3)
    first = ranks.start(1, on_serve=lambda key: first.kill() if key == "sendrecv 1->2" else None)
    ranks.start(0)
    ranks.start(2)
    ranks.join(1)
    assert isinstance(ranks.codes[1], workload.Killed), ranks.text(1)

    # the replacement, on a new address; every rank's list is replaced with it
    ranks.listeners[1] = socket.create_server(("127.0.0.1", 0))
    ranks.ports[1] = ranks.listeners[1].getsockname()[1]
    killed_lines = list(ranks.lines[1])
    ranks.lines[1].clear()
    ranks.write()
    ranks.start(1)
    codes = ranks.join()
    assert codes == {0: 0, 1: 0, 2: 0}, {i: ranks.text(i) for i in range(3)} | {"killed": killed_lines}
    text2 = ranks.text(2)
    assert re.search(r"round 1: rank 1 \(node-1 127\.0\.0\.1:\d+\): .*; re-reading the peer list and retrying "
                     r"the round", text2), text2
    assert f"1 node-1 127.0.0.1:{ranks.ports[1]} Ready" in text2  # it saw the new address in its list
    assert re.search(r"step 1/2 sendrecv .* 1 -> 2: recv 65536 bytes .* ok", text2)
    assert ranks.lines[2][-1].startswith("[rank 2/3] PASSED")


def test_a_repeated_run_outlives_a_rank_killed_in_its_middle(tmp_path: Path) -> None:
    """--repeat 4: rank 1 dies while serving the third repeat's step (the failover rows' force-deleted worker), comes
    back at a new address and the run completes, every repeat's checksum verified by its receiver."""
    ranks = Ranks(tmp_path, 2)
    ranks.cfg = {"repeat": 4, "interval": 0.01}
    first = ranks.start(1, on_serve=lambda key: first.kill() if key == "sendrecv 1->0 #2" else None)
    ranks.start(0)
    ranks.join(1)
    assert isinstance(ranks.codes[1], workload.Killed), ranks.text(1)
    assert "(repeat 2/4)" in ranks.text(0)  # it was in the middle of the run
    ranks.listeners[1] = socket.create_server(("127.0.0.1", 0))
    ranks.ports[1] = ranks.listeners[1].getsockname()[1]
    ranks.lines[1].clear()
    ranks.write()
    ranks.start(1)
    codes = ranks.join()
    assert codes == {0: 0, 1: 0}, {i: ranks.text(i) for i in range(2)}
    for i in range(2):
        assert re.search(r"step 1/2 sendrecv .* \(repeat 4/4\): recv 65536 bytes .* ok", ranks.text(i)), ranks.text(i)
        assert ranks.lines[i][-1].startswith(f"[rank {i}/2] PASSED nickelpie: 2 ranks, 65536 bytes per step: "
                                             "sendrecv around the ring and broadcast from rank 0, 4 times")


def test_a_corrupted_payload_fails_the_receiver_and_the_run(tmp_path: Path) -> None:
    """Rank 0 flips a byte of what it sends after taking its checksum: rank 1 finds the checksum wrong, fails and
    tells rank 0, which fails and tells the others."""
    ranks = Ranks(tmp_path, 2)
    ranks.start(0, tamper=lambda data: bytes([data[0] ^ 1]) + data[1:])
    ranks.start(1)
    codes = ranks.join()
    assert codes == {0: 1, 1: 1}, {i: ranks.text(i) for i in range(2)}
    assert re.search(r"\[rank 1/2\] FAILED nickelpie: step 1/2 sendrecv .* 0 -> 1: checksum mismatch: received "
                     r"65536 bytes from rank 0", ranks.lines[1][-1]), ranks.text(1)
    assert "the receiver found the checksum wrong" in ranks.text(0)
    assert re.search(r"\[rank 0/2\] FAILED nickelpie: rank 1 \(node-1 .*\) failed: step 1/2 .* checksum mismatch",
                     ranks.lines[0][-1]), ranks.text(0)


def test_ranks_started_with_different_flags_fail_at_once_naming_the_fix(tmp_path: Path) -> None:
    ranks = Ranks(tmp_path, 2)
    ranks.start(0)
    ranks.start(1, config={"nbytes": 4096})
    codes = ranks.join()
    assert codes == {0: 1, 1: 1}, {i: ranks.text(i) for i in range(2)}
    for i in range(2):
        # each is refused by the other, or told why the other failed
        assert re.search(r"FAILED nickelpie: (rank 0 aborted the run: |rank 1 \(node-1 .*\) failed: )?rank \d \(node-\d .*\) refused: a different "
                         r"run: it runs .*bytes=\d+.*, the asker .*bytes=\d+.*; fix: the same pattern and flags in "
                         r"every Pod of the Job$", ranks.lines[i][-1]), ranks.text(i)


def test_a_peer_missing_from_the_list_until_the_deadline_is_named(tmp_path: Path) -> None:
    peers = tmp_path / "peers"
    peers.write_text("# GPUDomain default/test: 3 node(s), sorted by index\n"
                     "0 node-a 127.0.0.1 Ready\n1 node-b 127.0.0.1 Ready\n3 node-d 127.0.0.1 NotReady\n")
    clock, lines = FakeClock(), []
    cfg = WorkloadConfig("nickelpie", 3, peers=str(peers), node_index=1, timeout=30.0, report_every=5.0)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        code = Rank(cfg, monotonic=clock.monotonic, sleep=clock.sleep, out=lines.append, listener=listener).run()
    assert code == 1
    assert lines[-1] == (f"[nickelpie] FAILED nickelpie: timed out after 30 s waiting for 3 Ready peers in {peers}: "
                         "2 of 3 Ready peers (0 node-a 127.0.0.1, 1 node-b 127.0.0.1); missing: index 2 (not in "
                         "the list), 3 node-d (NotReady)")
    waits = [line for line in lines if "waiting for 3 Ready peers" in line]
    assert 6 <= len(waits) <= 8, lines  # every 5 s of the 30, not at each of the 120 reads
    assert clock.now == pytest.approx(1030.0, abs=0.3)


def test_a_listed_peer_that_never_answers_fails_the_run_at_the_deadline_naming_it(tmp_path: Path) -> None:
    """Rank 1 is in the list, Ready, but its address accepts and never answers: every operation's timeout ends
    each try, and at the deadline the run fails naming rank 1."""
    ranks = Ranks(tmp_path, 2, timeout=1.5, io_timeout=0.2)
    ranks.start(0)  # rank 1's listener listens (the kernel accepts) and nobody answers
    codes = ranks.join(0)
    ranks.listeners[1].close()
    assert codes[0] == 1
    assert re.fullmatch(rf"\[rank 0/2\] FAILED nickelpie: timed out after 1\.5 s in round \d+: rank 1 \(node-1 "
                        rf"127\.0\.0\.1:{ranks.ports[1]}\): no answer within 0\.\d+ s", ranks.lines[0][-1]), ranks.text(0)
    assert "re-reading the peer list and retrying the round" in ranks.text(0)


def test_the_peer_list_the_node_agent_writes_is_the_one_read() -> None:
    from gpu_agent.mechanisms.domain.reconciler import render_peers

    obj = {"status": {"nodes": [{"name": "b", "ip": "10.0.0.2", "index": 1, "status": "NotReady"},
                                {"name": "a", "ip": "10.0.0.1", "index": 0, "status": "Ready"},
                                {"name": "c", "index": 2, "status": "Ready"},
                                {"name": "v6", "ip": "fd00::3", "index": 3, "status": "Ready"}]}}
    listed = workload.parse_peers(render_peers("ns", "dom", obj), "peers")  # type: ignore[arg-type]
    assert [p.line() for p in listed.peers] == ["0 a 10.0.0.1 Ready", "1 b 10.0.0.2 NotReady", "2 c - Ready",
                                                "3 v6 fd00::3 Ready"]
    assert listed.peers[2].host == "" and listed.peers[3].address(29500) == ("fd00::3", 29500)
    assert workload.parse_peers("0 a [::1]:7 Ready\n", "p").peers[0].where(1) == "[::1]:7"


@pytest.mark.parametrize("text,says", [
    ("0 node-a 10.0.0.1\n", "peer list P line 1 ('0 node-a 10.0.0.1'): 3 fields where a line has 4, <index> "
                            "<node name> <ip or -> <Ready|NotReady>"),
    ("# x\nzero node-a 10.0.0.1 Ready\n", "line 2 ('zero node-a 10.0.0.1 Ready'): the index 'zero' is not a number"),
    ("0 a 10.0.0.1 Up\n", "the status 'Up' is neither Ready nor NotReady"),
    ("0 a 10.0.0.999 Ready\n", "'10.0.0.999' is neither an ip address nor -"),
    ("0 a 10.0.0.1 Ready\n0 b 10.0.0.2 Ready\n", "index 0 is listed twice (a and b)"),
])
def test_a_malformed_peer_list_is_one_line_naming_the_line_the_problem_and_the_fix(text: str, says: str) -> None:
    with pytest.raises(WorkloadError) as error:
        workload.parse_peers(text, "P")
    message = str(error.value)
    assert says in message and "\n" not in message
    assert message.endswith("fix: the node agent writes it for a Pod that claims the domain's channel "
                            "(GPU_AGENT_DOMAIN_PEERS names it); point --peers at that file")


def test_settings_come_from_the_channels_environment_unless_a_flag_says_otherwise() -> None:
    env = {"GPU_AGENT_DOMAIN": "ns/dom", "GPU_AGENT_DOMAIN_CLIQUE": "", "GPU_AGENT_DOMAIN_NODE_INDEX": "",
           "GPU_AGENT_DOMAIN_PEERS": "/x/peers", "NODE_NAME": "node-b",
           "NVIDIA_VISIBLE_DEVICES": "GPU-aaaa,GPU-bbbb, GPU-cccc"}
    cfg = workload.settings("nvbandwidth", world=2, env=env)
    assert (cfg.peers, cfg.node_index, cfg.node_name, cfg.gpus_per_node, cfg.domain) == (
        "/x/peers", None, "node-b", 3, "ns/dom")
    cfg = workload.settings("nickelpie", world=2, env={**env, "GPU_AGENT_DOMAIN_NODE_INDEX": "4"}, gpus_per_node=1,
                            peers="/y")
    assert (cfg.peers, cfg.node_index, cfg.gpus_per_node) == ("/y", 4, 1)
    assert workload.settings("nickelpie", world=1, env={"NODE_NAME": "n"}).peers == workload.DEFAULT_PEERS
    assert workload.count_gpus("all") == workload.count_gpus("") == 1
    with pytest.raises(WorkloadError, match="this Pod's node is unknown: GPU_AGENT_DOMAIN_NODE_INDEX is empty and "
                                            "NODE_NAME is not set; fix: set NODE_NAME from the downward API"):
        workload.settings("nickelpie", world=2, env={})
    with pytest.raises(WorkloadError, match="GPU_AGENT_DOMAIN_NODE_INDEX is 'x', not a node index"):
        workload.settings("nickelpie", world=2, env={"GPU_AGENT_DOMAIN_NODE_INDEX": "x"})
    with pytest.raises(WorkloadError, match=r"--world must be 1 or more .*; got 0; --bytes must be 1\.\.1073741824"):
        workload.settings("nickelpie", world=0, env=env, nbytes=0)


def gpu_agent(*argv: str, env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_AGENT_", "NVIDIA_", "NODE_NAME"))}
    # this checkout's package, whatever the working directory (a relative PYTHONPATH would miss it there)
    environ["PYTHONPATH"] = os.pathsep.join([str(AGENT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return subprocess.Popen([sys.executable, "-m", "gpu_agent", "workload", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd, env={**environ, **env})


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return int(s.getsockname()[1])


def test_the_command_runs_nickelpie_between_two_processes(tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    text = "# GPUDomain default/d: 2 node(s), sorted by index\n" + "".join(
        f"{i} node-{i} 127.0.0.1:{p} Ready\n" for i, p in enumerate(ports))
    procs = []
    for i in range(2):
        (tmp_path / f"peers-{i}").write_text(text)
        env = {"GPU_AGENT_DOMAIN": "default/d", "GPU_AGENT_DOMAIN_PEERS": str(tmp_path / f"peers-{i}"),
               "GPU_AGENT_DOMAIN_NODE_INDEX": str(i), "GPU_AGENT_DOMAIN_CLIQUE": ""}
        procs.append(gpu_agent("nickelpie", "--world", "2", "--port", str(ports[i]), "--timeout", "30",
                               "--bytes", "4096", env=env, cwd=tmp_path))
    results = [p.communicate(timeout=60) for p in procs]
    for i, (p, (out, err)) in enumerate(zip(procs, results, strict=True)):
        assert p.returncode == 0, out + err
        assert "world of default/d: rank 0 = node-0" in out
        assert out.splitlines()[-1].startswith(f"[rank {i}/2] PASSED nickelpie: 2 ranks, 4096 bytes per step"), out


@pytest.mark.parametrize("argv,peers,says", [
    (["nickelpie", "--world", "2", "--node-index", "0"], "0 a 10.0.0.1 Ready\n1 b 10.0.0.2\n",
     "gpu-agent workload: error: peer list PEERS line 2 ('1 b 10.0.0.2'): 3 fields where a line has 4"),
    (["nickelpie", "--world", "2", "--node-index", "0"], None,
     "gpu-agent workload: error: peer list PEERS does not exist; fix: the node agent writes it"),
    (["nvbandwidth", "--world", "2", "--node-index", "0", "--iterations", "0"], "",
     "gpu-agent workload: error: --iterations must be 1 or more; got 0"),
])
def test_bad_arguments_and_peer_lists_exit_2_with_one_line_and_no_traceback(tmp_path: Path, argv: list[str],
                                                                            peers: str | None, says: str) -> None:
    path = tmp_path / "peers"
    if peers is not None:
        path.write_text(peers)
    p = gpu_agent(*argv, "--peers", str(path), "--port", str(free_port()), env={}, cwd=tmp_path)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2, out + err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(says.replace("PEERS", str(path))), err


def test_the_manifest_is_an_indexed_job_of_one_pod_per_node_running_the_command() -> None:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(REPO / "e2e" / "manifests"),
                             undefined=jinja2.StrictUndefined)
    template = env.get_template("domain-workload.yaml.j2")
    job = yaml.safe_load(template.render(name="npie", n=3, pattern="nickelpie", claim_template="dom-channel",
                                         image="localhost/gpu-agent:dev", pull_policy="Never"))
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert (job["kind"], spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Job", "Indexed", 3, 3)
    assert spec["backoffLimitPerIndex"] >= 1 and pod["restartPolicy"] == "Never"
    term = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    assert pod["resourceClaims"] == [{"name": "channel", "resourceClaimTemplateName": "dom-channel"}]
    container = pod["containers"][0]
    assert container["command"][:5] == ["gpu-agent", "workload", "nickelpie", "--world", "3"]
    assert (container["image"], container["imagePullPolicy"]) == ("localhost/gpu-agent:dev", "Never")
    assert container["resources"]["claims"] == [{"name": "channel"}]
    assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in container["env"]
    # the command line is one the parser takes
    from gpu_agent import cli

    args = cli.build_parser().parse_args(container["command"][1:])
    assert (args.pattern, args.world, args.port) == ("nickelpie", 3, 29500)
    other = yaml.safe_load(template.render(name="nvb", n=2, pattern="nvbandwidth", claim_template="c", image="i",
                                           gpu_claim_template="two-gpus", host_network=False, bytes=4096,
                                           args=["--iterations", "3"]))
    pod = other["spec"]["template"]["spec"]
    assert "hostNetwork" not in pod and pod["containers"][0]["ports"][0]["hostPort"] == 29500
    assert [c["name"] for c in pod["resourceClaims"]] == ["channel", "gpus"]
    assert pod["containers"][0]["command"][-4:] == ["--bytes", "4096", "--iterations", "3"]
    import kubernetes_validate

    for doc in (job, other):
        kubernetes_validate.validate(doc, "1.36", strict=True)
