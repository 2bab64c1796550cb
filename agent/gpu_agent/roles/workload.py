"""`gpu-agent workload <pattern>`: a multi-node workload of ours, run by the Pods of an indexed Job whose Pods use a
GPUDomain's channel (e2e/manifests/domain-workload.yaml.j2), one Pod per node, over TCP (no NVLink needed).

What a Pod gets from the node agent through the channel's CDI spec: GPU_AGENT_DOMAIN (<namespace>/<name>),
GPU_AGENT_DOMAIN_CLIQUE, GPU_AGENT_DOMAIN_NODE_INDEX (empty while unknown), GPU_AGENT_DOMAIN_PEERS (the peer list's
path, /etc/gpu-agent/domain/peers by default) and, when it claims GPUs too, NVIDIA_VISIBLE_DEVICES. The peer list is
the node agent's peers file (mechanisms/domain/reconciler.py, PEERS_TEMPLATE): a `#` comment line, then one line per
node, `<index> <node name> <ip or -> <Ready|NotReady>`, sorted by index. It is replaced atomically as members come
and go, so it is read again, whole, every time it is needed.

Ranks. This Pod's node is found in the list by GPU_AGENT_DOMAIN_NODE_INDEX, or by its name (NODE_NAME, from the
downward API) while the index is empty. The world is the first `--world` Ready peers with an ip, by index; a rank
is its node's place in it (its index, where the indices are 0..N-1). Each rank listens on `--port` on all addresses
and reaches the others at the ip the list gives (a line's ip may carry its own port, `127.0.0.1:29501`: several
ranks on one host, as the unit tests run them).

Patterns (both mirror NVIDIA's multi-node tests):
- nickelpie: send/recv around the ring (rank 0 -> 1 -> ... -> 0), then a broadcast from rank 0; every payload's
  SHA-256 is checked by its receiver, which acknowledges it to the sender; each side prints a line per step. With
  `--repeat K` the two steps run K times (`--interval` seconds apart): a run long enough to lose a Pod in the middle of.
- nvbandwidth: every rank measures the bandwidth from every other node/GPU pair to each of its own (`--bytes` per
  iteration, `--iterations`, one connection per pair, timed on the monotonic clock); rank 0 gathers the cells and
  prints the all-pairs table in nvbandwidth's layout (rows: from, columns: to, GB/s); a missing cell fails the run.

Transfers are pulls: a receiver asks the sender for a step's payload (its bytes derive from the run and the step,
so any incarnation of the sender serves the same ones) and acknowledges the checksum. A broken, refused or silent
connection (a peer's Pod force-deleted and recreated, maybe with a new ip) makes the rank re-read the peer list and
retry its whole round, until `--timeout`. Rank 0 then confirms, in one sweep, that every rank answers `done`, and
tells each that the run is finished; nobody leaves before that, so a recreated rank still finds the data it needs.
A rank that fails (a checksum that does not match, a peer that reported failing, the deadline) prints FAILED with
the reason and tells rank 0, which tells the others. Every socket operation has a timeout (`--io-timeout`, bounded by
what is left of `--timeout`).

Output: lines prefixed `[rank R/N]`, the peers seen in the list (names and ips) whenever it changes, and a last line
`[rank R/N] PASSED ...` (exit 0) or `... FAILED <why>` (exit 1). A bad argument or a peer list that cannot be read or
parsed raises WorkloadError: one line naming the problem and the fix (the command exits 2)."""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import math
import random
import re
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_agent.foundations.config import ConfigError

PATTERNS = ("nickelpie", "nvbandwidth")
DEFAULT_PEERS = "/etc/gpu-agent/domain/peers"
DEFAULT_PORT = 29500
DEFAULT_TIMEOUT = 300.0
DEFAULT_BYTES = 1 << 20
DEFAULT_ITERATIONS = 5
DEFAULT_IO_TIMEOUT = 10.0
MAX_BYTES = 1 << 30
EXIT_PASSED = 0
EXIT_FAILED = 1
PROTOCOL = "gpu-agent-workload/1"
MAX_MESSAGE = 1 << 22
MAX_CONNECTIONS = 64  # answered at once; a connection beyond is closed at once (the asker retries)
BANDWIDTH_KEY = "bandwidth"
NOTICE_SECONDS = 2.0  # the bound of telling the others of a failure, past the deadline if need be
LINE_FORMAT = "<index> <node name> <ip or -> <Ready|NotReady>"
PEERS_FIX = ("fix: the node agent writes it for a Pod that claims the domain's channel (GPU_AGENT_DOMAIN_PEERS names "
             "it); point --peers at that file")


class WorkloadError(ConfigError):
    """A bad argument, or a peer list that cannot be read or parsed: one line naming the problem and the fix."""


class RunFailed(Exception):
    """The run failed; the message is the one-line reason the FAILED line gives."""


class PeerLost(Exception):
    """A connection to a peer broke, was refused or went silent: the round is retried."""

    def __init__(self, who: str, why: str) -> None:
        super().__init__(f"{who}: {why}")
        self.who = who
        self.why = why


class ProtocolError(Exception):
    """What came over a connection is not this protocol's (a frame cut short, not JSON, too long)."""


class Finished(Exception):
    """Rank 0 said the run finished before this rank's own round did (this Pod replaced one that was done)."""


class Killed(Exception):
    """The rank was killed from outside (the unit tests' stand-in for a force-deleted Pod)."""


# --- the peer list ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Peer:
    index: int
    name: str
    host: str  # "" where the list says "-" (not known yet)
    port: int | None  # a line's own port (ip:port), else None: --port
    ready: bool

    def address(self, port: int) -> tuple[str, int]:
        return self.host, self.port or port

    def where(self, port: int) -> str:
        if not self.host:
            return "-"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port or port}"

    def ip(self) -> str:
        """The ip field as the list wrote it."""
        if not self.host:
            return "-"
        if self.port is None:
            return self.host
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def line(self) -> str:
        return f"{self.index} {self.name} {self.ip()} {'Ready' if self.ready else 'NotReady'}"


@dataclass(frozen=True)
class PeerList:
    path: str
    peers: tuple[Peer, ...]

    def by_index(self, index: int) -> Peer | None:
        return next((p for p in self.peers if p.index == index), None)

    def by_name(self, name: str) -> Peer | None:
        return next((p for p in self.peers if p.name == name), None)

    def summary(self) -> str:
        return "; ".join(p.line() for p in self.peers) or "no nodes"


def _host_port(field: str) -> tuple[str, int | None]:
    """An ip field: `-`, an IPv4 or IPv6 address, or either with a port (`1.2.3.4:5`, `[::1]:5`)."""
    if field == "-":
        return "", None
    host, port = field, None
    if field.startswith("["):
        inside, sep, rest = field[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"ip {field!r} is not an address")
        host = inside
        port = int(rest[1:]) if rest else None
    elif field.count(":") == 1:
        host, _, text = field.partition(":")
        port = int(text)
    ipaddress.ip_address(host)  # ValueError when it is not one
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"port {port} is out of range")
    return host, port


def parse_peers(text: str, path: str) -> PeerList:
    """The peer list in `text`; WorkloadError naming the line and what is wrong with it."""
    peers: dict[int, Peer] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        where = f"peer list {path} line {number} ({line[:120]!r})"
        if len(fields) != 4:
            raise WorkloadError(f"{where}: {len(fields)} fields where a line has 4, {LINE_FORMAT}; {PEERS_FIX}")
        index_text, name, ip, status = fields
        if not index_text.isdigit():
            raise WorkloadError(f"{where}: the index {index_text!r} is not a number; {PEERS_FIX}")
        if status not in ("Ready", "NotReady"):
            raise WorkloadError(f"{where}: the status {status!r} is neither Ready nor NotReady; {PEERS_FIX}")
        try:
            host, port = _host_port(ip)
        except ValueError:
            raise WorkloadError(f"{where}: {ip!r} is neither an ip address nor -; {PEERS_FIX}") from None
        index = int(index_text)
        if index in peers:
            raise WorkloadError(f"{where}: index {index} is listed twice ({peers[index].name} and {name}); "
                                f"{PEERS_FIX}")
        peers[index] = Peer(index, name, host, port, status == "Ready")
    return PeerList(path, tuple(peers[i] for i in sorted(peers)))


def read_peers(path: str) -> PeerList:
    """Read and parse the peer list now (never an open file kept: the node agent replaces it by a rename)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise WorkloadError(f"peer list {path} does not exist; {PEERS_FIX}") from None
    except UnicodeDecodeError:
        raise WorkloadError(f"peer list {path} is not UTF-8 text; {PEERS_FIX}") from None
    except OSError as e:
        raise WorkloadError(f"peer list {path} cannot be read ({e.strerror or e}); {PEERS_FIX}") from None
    return parse_peers(text, path)


# --- settings ----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class WorkloadConfig:
    pattern: str
    world: int
    peers: str = DEFAULT_PEERS
    node_index: int | None = None  # this Pod's node's index (GPU_AGENT_DOMAIN_NODE_INDEX); None: found by node_name
    node_name: str = ""
    port: int = DEFAULT_PORT
    timeout: float = DEFAULT_TIMEOUT
    nbytes: int = DEFAULT_BYTES
    iterations: int = DEFAULT_ITERATIONS
    repeat: int = 1  # nickelpie: how many times the ring and the broadcast run
    interval: float = 0.0  # nickelpie: seconds between two repeats
    gpus_per_node: int = 1
    io_timeout: float = DEFAULT_IO_TIMEOUT
    domain: str = ""
    clique: str = ""
    poll: float = 0.25  # how often the list is re-read and a waiting peer asked again
    report_every: float = 5.0  # how often a wait says what it waits for

    def check(self) -> None:
        problems = []
        if self.pattern not in PATTERNS:
            problems.append(f"the pattern {self.pattern!r} is not one of {', '.join(PATTERNS)}")
        if self.world < 1:
            problems.append(f"--world must be 1 or more (one Pod per node); got {self.world}")
        if not 0 < self.port < 65536:
            problems.append(f"--port must be 1..65535; got {self.port}")
        if not (self.timeout > 0 and math.isfinite(self.timeout)):
            problems.append(f"--timeout must be above 0 seconds; got {self.timeout:g}")
        if not (self.io_timeout > 0 and math.isfinite(self.io_timeout)):
            problems.append(f"--io-timeout must be above 0 seconds; got {self.io_timeout:g}")
        if not 0 < self.nbytes <= MAX_BYTES:
            problems.append(f"--bytes must be 1..{MAX_BYTES}; got {self.nbytes}")
        if self.iterations < 1:
            problems.append(f"--iterations must be 1 or more; got {self.iterations}")
        if self.repeat < 1:
            problems.append(f"--repeat must be 1 or more; got {self.repeat}")
        if not (self.interval >= 0 and math.isfinite(self.interval)):
            problems.append(f"--interval must be 0 seconds or more; got {self.interval:g}")
        if self.gpus_per_node < 1:
            problems.append(f"--gpus-per-node must be 1 or more; got {self.gpus_per_node}")
        if self.node_index is not None and self.node_index < 0:
            problems.append(f"the node index must be 0 or more; got {self.node_index}")
        if self.node_index is None and not self.node_name:
            problems.append("this Pod's node is unknown: GPU_AGENT_DOMAIN_NODE_INDEX is empty and NODE_NAME is not "
                            "set; fix: set NODE_NAME from the downward API (fieldRef spec.nodeName), as "
                            "e2e/manifests/domain-workload.yaml.j2 does, or pass --node-name or --node-index")
        if problems:
            raise WorkloadError("; ".join(problems))


def count_gpus(visible: str) -> int:
    """The GPUs NVIDIA_VISIBLE_DEVICES names by UUID (GPU-..., MIG-...), at least 1."""
    return max(1, sum(1 for d in visible.split(",") if d.strip().startswith(("GPU-", "MIG-"))))


def settings(pattern: str, *, world: int, env: Mapping[str, str], peers: str | None = None,
             node_index: int | None = None, node_name: str | None = None, port: int = DEFAULT_PORT,
             timeout: float = DEFAULT_TIMEOUT, nbytes: int = DEFAULT_BYTES, iterations: int = DEFAULT_ITERATIONS,
             gpus_per_node: int | None = None, io_timeout: float = DEFAULT_IO_TIMEOUT, repeat: int = 1,
             interval: float = 0.0) -> WorkloadConfig:
    """The run's settings: the flags given (not None), else what the channel's CDI spec put in `env`; checked."""
    if node_index is None:
        text = env.get("GPU_AGENT_DOMAIN_NODE_INDEX", "").strip()
        if text and not text.isdigit():
            raise WorkloadError(f"GPU_AGENT_DOMAIN_NODE_INDEX is {text!r}, not a node index; fix: it comes from the "
                                "domain channel's CDI spec, pass --node-index to override it")
        node_index = int(text) if text else None
    cfg = WorkloadConfig(
        pattern=pattern, world=world, peers=peers or env.get("GPU_AGENT_DOMAIN_PEERS") or DEFAULT_PEERS,
        node_index=node_index, node_name=env.get("NODE_NAME", "") if node_name is None else node_name,
        port=port, timeout=timeout, nbytes=nbytes, iterations=iterations, repeat=repeat, interval=interval,
        gpus_per_node=count_gpus(env.get("NVIDIA_VISIBLE_DEVICES", "")) if gpus_per_node is None else gpus_per_node,
        io_timeout=io_timeout, domain=env.get("GPU_AGENT_DOMAIN", ""), clique=env.get("GPU_AGENT_DOMAIN_CLIQUE", ""))
    cfg.check()
    return cfg


# --- the wire: a 4-byte length, a JSON object, and for a payload its bytes --------------------------------------------

_LENGTH = struct.Struct("!I")


def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ProtocolError(f"the connection closed after {got} of {n} bytes")
        got += k
    return buf


def recv_message(sock: socket.socket) -> dict[str, Any]:
    (n,) = _LENGTH.unpack(recv_exact(sock, _LENGTH.size))
    if n > MAX_MESSAGE:
        raise ProtocolError(f"a message of {n} bytes is not this protocol's (another service on the port?)")
    try:
        message = json.loads(recv_exact(sock, n))
    except ValueError:
        raise ProtocolError("a message that is not JSON (another service on the port?)") from None
    if not isinstance(message, dict):
        raise ProtocolError("a message that is not a JSON object")
    return message


def _reason(error: BaseException, timeout: float) -> str:
    if isinstance(error, socket.timeout):
        return f"no answer within {timeout:.3g} s"
    if isinstance(error, ConnectionRefusedError):
        return "connection refused (not listening: not started yet, or gone)"
    if isinstance(error, ConnectionResetError | BrokenPipeError):
        return "the connection was reset (the peer went away)"
    if isinstance(error, OSError):
        return error.strerror or str(error) or type(error).__name__
    return str(error)


def payload(run: str, key: str, nbytes: int) -> bytes:
    """A step's payload: the same bytes in every process of the run (a seed from the run and the step)."""
    return random.Random(f"{run}|{key}").randbytes(nbytes)


def sha256(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / 1e9


def bandwidth_table(labels: list[str], cells: Mapping[tuple[str, str], float], unit: str) -> list[str]:
    """nvbandwidth's layout: a header, a row per source, a column per destination, GB/s with 2 decimals (N/A on
    the diagonal), then the SUM line."""
    first = max(3, max((len(label) for label in labels), default=1) + 1)
    lines = [f"tcp {unit}(row) -> {unit}(column) bandwidth (GB/s)",
             " " * first + "".join(f"{label:>10}" for label in labels)]
    for src in labels:
        row = "".join(f"{'N/A' if src == dst else format(cells[(src, dst)], '.2f'):>10}" for dst in labels)
        lines.append(f"{src:>{first - 1}} {row}")
    lines += ["", f"SUM tcp_{unit.replace(':', '_')}_to_{unit.replace(':', '_')} {sum(cells.values()):.2f}"]
    return lines


# --- a rank ----------------------------------------------------------------------------------------------------------

Out = Callable[[str], None]


class Rank:
    """One rank of a run: a server thread answering the peers, and `run()`, which returns the exit code.

    `monotonic` and `sleep` are the clock (the waits and the timing); `listener`, a socket already listening, replaces
    binding --port (tests bind 127.0.0.1:0). Test seams: `on_serve(key)` runs before a payload is sent, `tamper`
    changes a payload after its checksum was taken, `kill()` closes every socket as a dying process would."""

    def __init__(self, cfg: WorkloadConfig, *, monotonic: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, out: Out = print,
                 listener: socket.socket | None = None, incarnation: str = "",
                 on_serve: Callable[[str], None] | None = None,
                 tamper: Callable[[bytes], bytes] | None = None) -> None:
        self.cfg = cfg
        self.monotonic = monotonic
        self.sleep = sleep
        self._out = out
        self._listener = listener
        self.incarnation = incarnation or uuid.uuid4().hex[:12]
        self.on_serve = on_serve
        self.tamper = tamper
        self.run_key = (f"{PROTOCOL} {cfg.pattern} domain={cfg.domain or '-'} world={cfg.world} bytes={cfg.nbytes} "
                        f"iterations={cfg.iterations} gpus={cfg.gpus_per_node}")
        self._lock = threading.Lock()
        self._print_lock = threading.Lock()
        self._state, self._why = "working", ""
        self._heard: dict[int, tuple[str, str, str]] = {}  # node index -> (state, incarnation, why), as last told
        self._verdict: tuple[bool, str] | None = None  # rank 0's word: (passed, why)
        self._finished = threading.Event()
        self._results: dict[str, float] | None = None  # nvbandwidth: "src>dst" -> GB/s measured here
        self._payloads: dict[str, tuple[bytes, str]] = {}
        self._sums: dict[str, str] = {}
        self._socks: set[socket.socket] = set()
        self._stop = threading.Event()
        self._killed = threading.Event()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._said: dict[str, tuple[str, float]] = {}
        self._shown_list: tuple[Peer, ...] | None = None
        self._shown_world: tuple[Peer, ...] | None = None
        self.prefix = f"[{cfg.pattern}]"
        self.me: Peer | None = None
        self.world: list[Peer] = []
        self.rank = -1
        self.deadline = 0.0

    # --- output ---------------------------------------------------------------------------------------------------

    def out(self, text: str) -> None:
        with self._print_lock:
            self._out(f"{self.prefix} {text}")

    def _say_every(self, channel: str, key: str, text: str) -> None:
        """Print `text` when what `channel` says changed (`key`), else at most every report_every seconds."""
        now = self.monotonic()
        last = self._said.get(channel)
        if last is None or last[0] != key or now - last[1] >= self.cfg.report_every:
            self._said[channel] = (key, now)
            self.out(text)

    # --- the run --------------------------------------------------------------------------------------------------

    def run(self) -> int:
        self.deadline = self.monotonic() + self.cfg.timeout
        listener = self._listener = self._listener or self._listen()
        listener.settimeout(0.1)  # the accept loop looks at _stop this often
        server = threading.Thread(target=self._serve, args=(listener,), daemon=True,
                                  name=f"workload-server-{self.incarnation}")
        server.start()
        try:
            try:
                note = self._rounds()
            except RunFailed as e:
                self._fail(str(e))
                self.out(f"FAILED {self.cfg.pattern}: {e}")
                return EXIT_FAILED
            self.out(f"PASSED {self.cfg.pattern}: {note}")
            return EXIT_PASSED
        finally:
            self._stop.set()
            self._close_all(listener)
            server.join(timeout=2.0)

    def kill(self) -> None:
        """Close every socket of this rank at once, as the kernel does for a process that dies."""
        self._killed.set()
        self._stop.set()
        self._close_all(self._listener)

    def _close_all(self, listener: socket.socket | None) -> None:
        with self._lock:
            socks = list(self._socks)
        for s in [*socks, *([listener] if listener is not None else [])]:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()

    def _listen(self) -> socket.socket:
        try:
            if socket.has_dualstack_ipv6():
                return socket.create_server(("::", self.cfg.port), family=socket.AF_INET6, dualstack_ipv6=True)
            return socket.create_server(("", self.cfg.port))
        except OSError as e:
            raise WorkloadError(f"cannot listen on port {self.cfg.port} ({e.strerror or e}); fix: another process "
                                "holds it (a second workload Pod on this node?): pass a free --port to every "
                                "rank") from None

    def _left(self) -> float:
        return self.deadline - self.monotonic()

    def _pause(self, seconds: float | None = None) -> None:
        """A wait of `seconds` (the poll interval unless given), bounded by the run's deadline, ended by a kill."""
        if self._killed.is_set():
            raise Killed()
        self.sleep(max(0.0, min(self.cfg.poll if seconds is None else seconds, self._left())))
        if self._killed.is_set():
            raise Killed()

    def _rounds(self) -> str:
        try:
            return self._round_after_round()
        except Finished as finished:
            return (f"{finished} (rank 0 had confirmed every rank done before this rank's own round completed: this "
                    "Pod replaced one that was done)")

    def _round_after_round(self) -> str:
        round_no = 0
        while True:
            round_no += 1
            self._check_word()
            world = self._wait_for_world()
            with self._lock:
                self._state, self._why, self._results = "working", "", None
            try:
                if self.cfg.pattern == "nickelpie":
                    summary = self._nickelpie(world)
                else:
                    summary = self._nvbandwidth(world)
                if self.rank == 0:
                    return self._coordinate(world, summary)
                return self._await_finish(summary)
            except PeerLost as lost:
                if self._killed.is_set():
                    raise Killed() from None
                if self._left() <= 0:
                    raise RunFailed(f"timed out after {self.cfg.timeout:g} s in round {round_no}: {lost}") from None
                self._say_every("round", str(lost), f"round {round_no}: {lost}; re-reading the peer list and retrying "
                                                   f"the round ({self._left():.0f} s left)")
                self._pause()

    def _check_word(self) -> None:
        """Between steps: what rank 0 said (the run finished or aborted) and whether a peer reported failing."""
        with self._lock:
            verdict = self._verdict
            failed = [(i, why) for i, (state, _, why) in self._heard.items() if state == "failed"]
        if verdict is not None and not verdict[0]:
            raise RunFailed(f"rank 0 aborted the run: {verdict[1]}")
        if verdict is not None:
            raise Finished(verdict[1])
        if failed:
            index, why = failed[0]
            raise RunFailed(f"{self._who_index(index)} failed: {why}")

    # --- the world: the peer list, re-read ------------------------------------------------------------------------

    def _read(self) -> PeerList:
        listed = read_peers(self.cfg.peers)
        if listed.peers != self._shown_list:
            self._shown_list = listed.peers
            self.out(f"peer list {listed.path}: {len(listed.peers)} node(s): {listed.summary()}")
        return listed

    def _find_me(self, listed: PeerList) -> Peer | None:
        if self.cfg.node_index is not None:
            return listed.by_index(self.cfg.node_index)
        return listed.by_name(self.cfg.node_name)

    def _myself(self) -> str:
        if self.cfg.node_index is not None:
            return f"this node (index {self.cfg.node_index})"
        return f"this node ({self.cfg.node_name})"

    def _missing(self, listed: PeerList, me: Peer | None, usable: list[Peer]) -> str:
        parts = [f"{len(usable)} of {self.cfg.world} Ready peers"
                 + (f" ({', '.join(f'{p.index} {p.name} {p.ip()}' for p in usable)})" if usable else "")]
        missing = []
        for index in range(self.cfg.world):
            peer = listed.by_index(index)
            if peer is None:
                missing.append(f"index {index} (not in the list)")
            elif not peer.ready:
                missing.append(f"{index} {peer.name} (NotReady)")
            elif not peer.host:
                missing.append(f"{index} {peer.name} (no ip yet)")
        missing += [f"{p.index} {p.name} (NotReady)" for p in listed.peers if p.index >= self.cfg.world and not p.ready]
        if missing:
            parts.append("missing: " + ", ".join(missing))
        if me is None:
            parts.append(f"{self._myself()} is not in the list yet")
        return "; ".join(parts)

    def _wait_for_world(self) -> list[Peer]:
        while True:
            if self._killed.is_set():
                raise Killed()
            listed = self._read()
            me = self._find_me(listed)
            usable = [p for p in listed.peers if p.ready and p.host]
            if me is not None and me.ready and me.host and len(usable) >= self.cfg.world:
                world = usable[:self.cfg.world]
                if me not in world:
                    raise RunFailed(f"{self._myself()} is Ready but not among the world's {self.cfg.world} "
                                    f"lowest-indexed Ready peers ({', '.join(p.name for p in world)}); fix: run one "
                                    f"Pod per Ready node of the domain, --world {len(usable)}")
                self._set_world(world, me)
                return world
            reason = self._missing(listed, me, usable)
            if self._left() <= 0:
                raise RunFailed(f"timed out after {self.cfg.timeout:g} s waiting for {self.cfg.world} Ready peers "
                                f"in {self.cfg.peers}: {reason}")
            self._say_every("world", reason, f"waiting for {self.cfg.world} Ready peers in {self.cfg.peers}: "
                                             f"{reason} ({self._left():.0f} s left)")
            self._pause()

    def _set_world(self, world: list[Peer], me: Peer) -> None:
        self.world, self.me, self.rank = world, me, world.index(me)
        self.prefix = f"[rank {self.rank}/{len(world)}]"
        if tuple(world) != self._shown_world:
            self._shown_world = tuple(world)
            domain = f" of {self.cfg.domain}" if self.cfg.domain else ""
            clique = f", clique {self.cfg.clique}" if self.cfg.clique else ""
            self.out(f"world{domain}{clique}: " + ", ".join(
                f"rank {r} = {p.name} {p.where(self.cfg.port)} (index {p.index})" for r, p in enumerate(world))
                     + f"; this is rank {self.rank} on {me.name}")

    def _who(self, peer: Peer) -> str:
        ranks = {p.index: r for r, p in enumerate(self.world)}
        rank = f"rank {ranks[peer.index]}" if peer.index in ranks else f"index {peer.index}"
        return f"{rank} ({peer.name} {peer.where(self.cfg.port)})"

    def _who_index(self, index: int) -> str:
        peer = next((p for p in self.world if p.index == index), None)
        return self._who(peer) if peer is not None else f"index {index}"

    def _asker(self, request: dict[str, Any]) -> str:
        """Who asked, by rank and name (its address in this rank's world may be an older one)."""
        index = request.get("index")
        peer = next((p for p in self.world if p.index == index), None)
        if peer is None:
            return f"index {index}" if index is not None else "a peer"
        return f"rank {self.world.index(peer)} ({peer.name})"

    def _fresh(self, peer: Peer) -> Peer:
        """`peer` as the list says now (its ip may have changed: a Pod recreated)."""
        return self._read().by_index(peer.index) or peer

    # --- talking to a peer ----------------------------------------------------------------------------------------

    def _io_timeout(self) -> float:
        return max(0.05, min(self.cfg.io_timeout, self._left()))

    def _track(self, sock: socket.socket, on: bool) -> None:
        with self._lock:
            if on:
                self._socks.add(sock)
            else:
                self._socks.discard(sock)

    @contextlib.contextmanager
    def _talk(self, peer: Peer) -> Iterator[socket.socket]:
        """A connection to `peer`, every operation bounded by the io timeout; any failure of it is PeerLost."""
        if self._killed.is_set():
            raise Killed()
        if not peer.host:
            raise PeerLost(self._who(peer), "the peer list has no ip for it yet")
        timeout = self._io_timeout()
        sock: socket.socket | None = None
        try:
            sock = socket.create_connection(peer.address(self.cfg.port), timeout=timeout)
            self._track(sock, True)
            yield sock
        except (OSError, ProtocolError, KeyError, TypeError, ValueError) as e:
            if self._killed.is_set():
                raise Killed() from None
            raise PeerLost(self._who(peer), _reason(e, timeout)) from None
        finally:
            if sock is not None:
                self._track(sock, False)
                sock.close()

    def _hello(self) -> dict[str, Any]:
        with self._lock:
            state, why = self._state, self._why
        return {"run": self.run_key, "index": self.me.index if self.me else None, "incarnation": self.incarnation,
                "state": state, "why": why}

    def _refused(self, peer: Peer, answer: dict[str, Any]) -> Exception:
        """A peer's no: PeerLost where it may say yes later (the round is retried), else the run fails."""
        if answer.get("retry"):
            return PeerLost(self._who(peer), f"not yet: {answer.get('error', '')}")
        return RunFailed(f"{self._who(peer)} refused: {answer.get('error', answer)}")

    def _data(self, key: str) -> tuple[bytes, str]:
        with self._lock:
            cached = self._payloads.get(key)
        if cached is None:
            data = payload(self.run_key, key, self.cfg.nbytes)
            cached = (data, sha256(data))
            with self._lock:
                self._payloads[key] = cached
        return cached

    def _sum(self, key: str) -> str:
        """The SHA-256 of a step's payload, without keeping the payload (a receiver of many)."""
        with self._lock:
            cached = self._payloads.get(key)
            known = self._sums.get(key)
        if cached is not None:
            return cached[1]
        if known is None:
            known = sha256(payload(self.run_key, key, self.cfg.nbytes))
            with self._lock:
                self._sums[key] = known
        return known

    def _pull(self, peer: Peer, key: str, label: str) -> None:
        """Receive step `key` from `peer`, check its checksum and acknowledge it (a send/recv pair)."""
        expected = self._sum(key)
        with self._talk(peer) as sock:
            started = self.monotonic()
            send_message(sock, {**self._hello(), "op": "get", "key": key, "label": label})
            head = recv_message(sock)
            if not head.get("ok"):
                raise self._refused(peer, head)
            size = int(head["bytes"])
            if size != self.cfg.nbytes:
                raise RunFailed(f"{label}: {self._who(peer)} sent {size} bytes where the run sends "
                                f"{self.cfg.nbytes} (a different --bytes?)")
            data = recv_exact(sock, size)
            took = self.monotonic() - started
            got = sha256(data)
            ok = got == head.get("sha256") == expected
            send_message(sock, {"op": "ack", "ok": ok, "sha256": got})
        if not ok:
            raise RunFailed(f"{label}: checksum mismatch: received {size} bytes from {self._who(peer)} with sha256 "
                            f"{got[:16]}, the sender's is {str(head.get('sha256'))[:16]}, the payload's "
                            f"{expected[:16]}")
        self.out(f"{label}: recv {size} bytes from {self._who(peer)} in {took:.4f} s ({gbps(size, took):.2f} GB/s), "
                 f"sha256 {got[:16]} ok")

    def _status(self, peer: Peer) -> tuple[str, str]:
        """Tell `peer` this rank's state and learn its own: (state, why)."""
        with self._talk(peer) as sock:
            send_message(sock, {**self._hello(), "op": "status"})
            answer = recv_message(sock)
        if not answer.get("ok"):
            raise self._refused(peer, answer)
        state, why = str(answer["state"]), str(answer.get("why", ""))
        with self._lock:
            self._heard[peer.index] = (state, str(answer.get("incarnation", "")), why)
        return state, why

    def _tell(self, peer: Peer, passed: bool, why: str) -> None:
        """Rank 0's word to `peer`: the run finished (passed) or aborted."""
        with self._talk(peer) as sock:
            send_message(sock, {**self._hello(), "op": "finish", "passed": passed, "why": why})
            recv_message(sock)

    # --- nickelpie --------------------------------------------------------------------------------------------------

    def _nickelpie(self, world: list[Peer]) -> str:
        n, r = len(world), self.rank
        if n == 1:
            self.out("a world of 1: nothing to send")
            return "a world of 1 rank, nothing to exchange"
        ring = " -> ".join(str(i) for i in [*range(n), 0])
        src, k = (r - 1) % n, self.cfg.repeat
        for i in range(k):
            # the first repeat keeps the keys a run of one has; later ones are keys of their own
            suffix, of = (f" #{i}" if i else ""), (f" (repeat {i + 1}/{k})" if k > 1 else "")
            if i:
                self._pause(self.cfg.interval)  # --interval between two repeats
            self._pull(world[src], f"sendrecv {src}->{r}{suffix}", f"step 1/2 sendrecv (ring {ring}) {src} -> {r}{of}")
            self._check_word()
            if r != 0:
                self._pull(world[0], f"broadcast 0{suffix}", f"step 2/2 broadcast from rank 0 -> {r}{of}")
            self._check_word()
        return (f"{n} ranks, {self.cfg.nbytes} bytes per step: sendrecv around the ring and broadcast from rank 0"
                f"{f', {k} times' if k > 1 else ''}, every checksum verified")

    # --- nvbandwidth ------------------------------------------------------------------------------------------------

    def _label(self, peer: Peer, gpu: int) -> str:
        return f"{peer.index}:{gpu}" if self.cfg.gpus_per_node > 1 else str(peer.index)

    def _measure(self, peer: Peer, src: str, dst: str) -> float:
        """The bandwidth from `src` (a node/GPU of `peer`) to `dst` (one of this node's), on its own connection."""
        key = BANDWIDTH_KEY  # one payload, sent by every source to every destination
        expected, n, k = self._sum(key), self.cfg.nbytes, self.cfg.iterations
        with self._talk(peer) as sock:
            started = self.monotonic()
            send_message(sock, {**self._hello(), "op": "bandwidth", "key": key, "iterations": k, "dst": dst})
            head = recv_message(sock)
            if not head.get("ok"):
                raise self._refused(peer, head)
            if int(head["bytes"]) != n * k:
                raise RunFailed(f"{src} -> {dst}: {self._who(peer)} sends {head['bytes']} bytes where the run "
                                f"sends {n * k} (a different --bytes or --iterations?)")
            data = recv_exact(sock, n * k)
            took = self.monotonic() - started
            sums = {sha256(memoryview(data)[i * n:(i + 1) * n]) for i in range(k)}
            ok = sums == {expected} and head.get("sha256") == expected
            send_message(sock, {"op": "ack", "ok": ok})
        if not ok:
            raise RunFailed(f"{src} -> {dst}: checksum mismatch in what {self._who(peer)} sent")
        value = gbps(n * k, took)
        self.out(f"measured {src} -> {dst}: {value:.2f} GB/s ({k} x {n} bytes in {took:.4f} s), checksums ok")
        return value

    def _nvbandwidth(self, world: list[Peer]) -> str:
        assert self.me is not None
        gpus = range(self.cfg.gpus_per_node)
        column: dict[str, float] = {}
        for dst_gpu in gpus:
            dst = self._label(self.me, dst_gpu)
            for peer in world:
                for src_gpu in gpus:
                    src = self._label(peer, src_gpu)
                    if src != dst:
                        column[f"{src}>{dst}"] = self._measure(peer, src, dst)
                        self._check_word()
        with self._lock:
            self._results = dict(column)
        if self.rank != 0:
            return f"{len(column)} cells measured into this rank's node, gathered by rank 0"
        return self._gather(world, column)

    def _gather(self, world: list[Peer], mine: dict[str, float]) -> str:
        """Rank 0: every rank's measurements, polled until each has them; the table, which must be complete."""
        cells = {tuple(k.split(">", 1)): v for k, v in mine.items()}
        waiting = [p for p in world if p != self.me]
        last: dict[int, str] = {}
        while waiting:
            for peer in list(waiting):
                try:
                    with self._talk(self._fresh(peer)) as sock:
                        send_message(sock, {**self._hello(), "op": "results"})
                        answer = recv_message(sock)
                except PeerLost as e:
                    last[peer.index] = e.why
                    continue
                if not answer.get("ok"):
                    raise self._refused(peer, answer)
                if answer.get("cells") is None:
                    last[peer.index] = "still measuring"
                    continue
                cells.update({tuple(k.split(">", 1)): float(v) for k, v in answer["cells"].items()})
                waiting.remove(peer)
            if not waiting:
                break
            self._check_word()
            pending = "; ".join(f"{self._who(p)}: {last.get(p.index, '')}" for p in waiting)
            if self._left() <= 0:
                raise RunFailed(f"timed out after {self.cfg.timeout:g} s gathering the measurements of {pending}")
            self._say_every("gather", pending, f"gathering the measurements: waiting for {pending}")
            self._pause()
        labels = [self._label(p, g) for p in world for g in range(self.cfg.gpus_per_node)]
        table = {(s, d): v for (s, d), v in cells.items() if s in labels and d in labels}
        empty = [f"{s} -> {d}" for s in labels for d in labels
                 if s != d and not (math.isfinite(table.get((s, d), math.nan)) and table[(s, d)] > 0)]
        if empty:
            raise RunFailed(f"the bandwidth table is incomplete: no value for {', '.join(empty)}")
        unit = "node:gpu" if self.cfg.gpus_per_node > 1 else "node"
        for line in bandwidth_table(labels, table, unit):
            self.out(line)
        return f"the {len(labels)} x {len(labels)} table is complete ({len(table)} cells measured)"

    # --- the end: rank 0 confirms every rank done, then says so -----------------------------------------------------

    def _coordinate(self, world: list[Peer], summary: str) -> str:
        others = [p for p in world if p != self.me]
        with self._lock:
            self._state = "done"
        while True:
            answers: dict[int, tuple[str, str]] = {}
            for peer in others:
                try:
                    answers[peer.index] = self._status(self._fresh(peer))
                except PeerLost as e:
                    answers[peer.index] = ("unreachable", e.why)
            self._check_word()
            failed = [(i, why) for i, (state, why) in answers.items() if state == "failed"]
            if failed:
                raise RunFailed(f"{self._who_index(failed[0][0])} failed: {failed[0][1]}")
            pending = [(i, s, why) for i, (s, why) in answers.items() if s != "done"]
            if not pending:
                break
            text = "; ".join(f"{self._who_index(i)} {s}" + (f" ({why})" if why else "") for i, s, why in pending)
            if self._left() <= 0:
                raise RunFailed(f"timed out after {self.cfg.timeout:g} s waiting for every rank to be done: {text}")
            self._say_every("barrier", text, f"waiting for every rank to be done: {text}")
            self._pause()
        self.out(f"every rank of {len(world)} is done: the run is finished")
        unheard = {p.index: p for p in others}
        while unheard:
            for peer in list(unheard.values()):
                with contextlib.suppress(PeerLost):
                    self._tell(self._fresh(peer), True, summary)
                    del unheard[peer.index]
            if not unheard or self._left() <= 0:
                break
            self._pause()
        if unheard:
            summary += f" (not told the run finished: {', '.join(self._who(p) for p in unheard.values())})"
        return summary

    def _await_finish(self, summary: str) -> str:
        with self._lock:
            self._state = "done"
        while not self._finished.is_set():
            with contextlib.suppress(Finished):  # the word came: the loop ends
                self._check_word()
            if self._left() <= 0:
                raise RunFailed(f"timed out after {self.cfg.timeout:g} s: rank 0 ({self.world[0].name}) never "
                                "confirmed every rank done")
            self._say_every("finish", "", "done; waiting for rank 0 to confirm every rank done")
            self._pause()
        with self._lock:
            verdict = self._verdict
        if verdict is not None and not verdict[0]:
            raise RunFailed(f"rank 0 aborted the run: {verdict[1]}")
        return summary

    def _fail(self, why: str) -> None:
        """Make the failure known: rank 0 tells every rank; another rank tells rank 0 (once each, best effort)."""
        with self._lock:
            self._state, self._why = "failed", why
        if not self.world or self.me is None:
            return
        for peer in self.world if self.rank == 0 else self.world[:1]:
            if peer == self.me:
                continue
            self.deadline = max(self.deadline, self.monotonic() + min(self.cfg.io_timeout, NOTICE_SECONDS))
            with contextlib.suppress(PeerLost, RunFailed, Killed, Finished):
                if self.rank == 0:
                    self._tell(peer, False, why)
                else:
                    self._status(peer)

    # --- the server: answers the peers ------------------------------------------------------------------------------

    def _serve(self, listener: socket.socket) -> None:
        """Accepts until the rank stops, each connection answered on a thread of its own; on the way out it waits for
        those (their sockets are closed by then, so each ends at once), so the server's end is the answers' end."""
        answers: list[threading.Thread] = []
        try:
            self._accept(listener, answers)
        finally:
            for answer in answers:
                answer.join(timeout=1.0)

    def _accept(self, listener: socket.socket, answers: list[threading.Thread]) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                self._stop.wait(0.05)  # out of descriptors, say: try again
                continue
            if not self._slots.acquire(blocking=False):
                conn.close()  # as many answered as MAX_CONNECTIONS: a flood, not the run's peers
                continue
            conn.settimeout(self.cfg.io_timeout)
            self._track(conn, True)
            answers[:] = [a for a in answers if a.is_alive()]
            answer = threading.Thread(target=self._answer, args=(conn,), daemon=True,
                                      name=f"workload-peer-{self.incarnation}")
            answers.append(answer)
            answer.start()

    def _answer(self, conn: socket.socket) -> None:
        try:
            with conn:
                request = recv_message(conn)
                if request.get("run") != self.run_key:
                    send_message(conn, {"ok": False, "error": f"a different run: it runs {self.run_key!r}, the "
                                                              f"asker {request.get('run')!r}; fix: the same pattern "
                                                              "and flags in every Pod of the Job"})
                    self._failure_notice(request)
                    return
                op = request.get("op")
                if op == "get":
                    self._answer_get(conn, request)
                elif op == "bandwidth":
                    self._answer_bandwidth(conn, request)
                elif op == "status":
                    self._answer_status(conn, request)
                elif op == "finish":
                    send_message(conn, {"ok": True})
                    with self._lock:
                        self._verdict = (bool(request.get("passed")), str(request.get("why", "")))
                    self._finished.set()
                elif op == "results":
                    with self._lock:
                        results = self._results
                    send_message(conn, {"ok": True, "cells": results})
                else:
                    send_message(conn, {"ok": False, "error": f"unknown op {op!r}"})
        except (OSError, ProtocolError, KeyError, TypeError, ValueError):
            pass  # the asker's connection broke or it sent nonsense: it retries, or is not ours
        finally:
            self._track(conn, False)
            self._slots.release()

    def _not_mine(self, key: str) -> dict[str, Any] | None:
        """Why this rank does not send step `key` (None: it does). Only its own steps are made and kept, whatever
        an asker names; while it has not found its rank, or sees another one than the asker, the asker retries."""
        repeat = r"(?: #(\d+))?"  # a later repeat's step (nickelpie --repeat)
        if m := re.fullmatch(rf"sendrecv (\d+)->(\d+){repeat}", key):
            src, dst = int(m.group(1)), int(m.group(2))
            mine = src < self.cfg.world and dst == (src + 1) % self.cfg.world and src == self.rank and \
                int(m.group(3) or 0) < self.cfg.repeat
        else:
            m = re.fullmatch(rf"broadcast 0{repeat}", key)
            mine = m is not None and self.rank == 0 and int(m.group(1) or 0) < self.cfg.repeat
        if mine:
            return None
        if self.rank < 0:
            return {"ok": False, "retry": True, "error": "not ready: it has not found itself in its peer list yet"}
        return {"ok": False, "retry": True, "error": f"it is rank {self.rank} of {len(self.world)} and sends no "
                                                    f"step {key[:80]!r} (its peer list differs?)"}

    def _failure_notice(self, request: dict[str, Any]) -> None:
        """A rank started with other flags that failed (because of this one) or aborted: this one fails with it,
        rather than wait for it to the deadline. Nothing else of such a rank is taken."""
        if request.get("op") == "finish" and not request.get("passed"):
            with self._lock:
                self._verdict = (False, str(request.get("why", "")))
            self._finished.set()
        elif request.get("op") == "status" and request.get("state") == "failed" and isinstance(request.get("index"),
                                                                                               int):
            with self._lock:
                self._heard[request["index"]] = ("failed", str(request.get("incarnation", "")),
                                                 str(request.get("why", "")))

    def _served(self, key: str) -> tuple[bytes, str]:
        """The payload of `key` as this rank serves it (a test's tamper applied) and the digest of the true one."""
        data, digest = self._data(key)
        if self.on_serve is not None:
            self.on_serve(key)
        if self.tamper is not None:
            data = self.tamper(data)
        return data, digest

    def _answer_get(self, conn: socket.socket, request: dict[str, Any]) -> None:
        key, label = str(request["key"]), str(request.get("label", request["key"]))
        if (refusal := self._not_mine(key)) is not None:
            send_message(conn, refusal)
            return
        data, digest = self._served(key)
        send_message(conn, {"ok": True, "bytes": len(data), "sha256": digest})
        conn.sendall(data)
        ack = recv_message(conn)
        who = self._asker(request)
        if ack.get("ok"):
            self.out(f"{label}: send {len(data)} bytes to {who}, checksum verified by the receiver")
        else:
            self.out(f"{label}: send {len(data)} bytes to {who}: the receiver found the checksum wrong")

    def _answer_bandwidth(self, conn: socket.socket, request: dict[str, Any]) -> None:
        key, k = str(request["key"]), int(request["iterations"])
        if key != BANDWIDTH_KEY:
            send_message(conn, {"ok": False, "error": f"no bandwidth payload {key[:80]!r} in this run"})
            return
        if k != self.cfg.iterations:
            send_message(conn, {"ok": False, "error": f"{k} iterations asked, {self.cfg.iterations} run"})
            return
        data, digest = self._served(key)
        send_message(conn, {"ok": True, "bytes": len(data) * k, "sha256": digest})
        for _ in range(k):
            conn.sendall(data)
        recv_message(conn)  # the receiver's ack: the bytes are in before this connection closes

    def _answer_status(self, conn: socket.socket, request: dict[str, Any]) -> None:
        with self._lock:
            state, why = self._state, self._why
        send_message(conn, {"ok": True, "index": self.me.index if self.me else None,
                            "incarnation": self.incarnation, "state": state, "why": why})
        index = request.get("index")
        if isinstance(index, int):  # recorded once answered: what the asker said is its latest word
            with self._lock:
                self._heard[index] = (str(request.get("state", "")), str(request.get("incarnation", "")),
                                      str(request.get("why", "")))


def run(cfg: WorkloadConfig, out: Out = print) -> int:
    """`gpu-agent workload`: one rank of the run, in this process; the exit code (0 PASSED, 1 FAILED)."""
    return Rank(cfg, out=out).run()
