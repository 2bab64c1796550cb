"""Slow clients and a sampler, over real sockets: what the slow-client tests (unit and integration) share."""

from __future__ import annotations

import os
import select
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import requests

BOUND = 1.0  # every probe answered within this (the kubelet's default timeoutSeconds)


def wait_until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)
    return value


class Sampler(threading.Thread):
    """GET `url` every `interval` until stopped; records (latency in seconds, status or the error's name)."""

    def __init__(self, url: str, interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.url, self.interval = url, interval
        self.samples: list[tuple[float, int | str]] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            started = time.monotonic()
            try:
                outcome: int | str = requests.get(self.url, timeout=BOUND * 2).status_code
            except requests.RequestException as e:
                outcome = type(e).__name__
            self.samples.append((time.monotonic() - started, outcome))
            self._stop_event.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def stop(self) -> list[tuple[float, int | str]]:
        self._stop_event.set()
        self.join(5)
        return self.samples

    def report(self, what: str) -> str:
        ok = sorted(d for d, c in self.samples if c == 200)
        worst = f"{ok[-1] * 1000:.1f}" if ok else "-"
        median = f"{ok[len(ok) // 2] * 1000:.1f}" if ok else "-"
        return f"{what}: {len(self.samples)} samples, {len(ok)} answered 200, median {median} ms, worst {worst} ms"


class SlowClients:
    """`n` connections to `address`, a quarter of each kind: silent (connects, sends nothing), partial (a request
    line and a header, then nothing), trickle (a header byte every 0.5 s, under any idle timeout), unread (a
    whole request whose answer it never reads; the answer fits its receive buffer, so the server's FIN arrives
    behind it: a client whose window is full is the test of answers left unread).

    They come from a process of their own (`python -m tests.slow_clients`), as an attacker's would: in the
    test's process, their threads would hold the GIL from the prober and the server, and the probes would
    measure that. It reports, line by line, when the server closes each one (seconds since it began opening)."""

    KINDS = ("silent", "partial", "trickle", "unread")

    def __init__(self, address: str, n: int) -> None:
        self.n = n
        self.closed_at: dict[int, float] = {}
        self.kinds: dict[int, str] = {}
        self.opened = threading.Event()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.slow_clients", address, str(n)], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        wait_until(self.opened.is_set, 30, f"{n} slow connections opened")

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            word, *rest = line.split()
            if word == "opened":
                self.opened.set()
            elif word == "closed":
                i, kind, at = rest
                self.kinds[int(i)] = kind
                self.closed_at[int(i)] = float(at)

    def all_closed(self) -> bool:
        return len(self.closed_at) == self.n

    def last_closed(self, kind: str | None = None) -> float:
        return max(at for i, at in self.closed_at.items() if kind is None or self.kinds[i] == kind)

    def close(self) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()  # the process closes its connections and exits
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(5)
        self._reader.join(5)


def _attack(address: str, n: int) -> None:
    """The slow clients' process: open, trickle, and report each connection the server closes."""
    host, port = address.rsplit(":", 1)
    started = time.monotonic()
    socks: list[tuple[str, socket.socket]] = []
    for i in range(n):
        kind = SlowClients.KINDS[i % 4]
        s = socket.create_connection((host, int(port)))
        if kind in ("partial", "trickle"):
            s.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\n")
        elif kind == "unread":
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        s.setblocking(False)
        socks.append((kind, s))
    print("opened", flush=True)
    done = threading.Event()
    closed: set[int] = set()

    def note(i: int) -> None:
        closed.add(i)
        print("closed", i, socks[i][0], f"{time.monotonic() - started:.3f}", flush=True)

    def trickle() -> None:
        while not done.wait(0.5):
            for i, (kind, s) in enumerate(socks):
                if kind == "trickle" and i not in closed:
                    try:
                        s.send(b"X")
                    except OSError:
                        pass

    def until_stdin_closes() -> None:
        sys.stdin.read()
        done.set()

    threading.Thread(target=trickle, daemon=True).start()
    threading.Thread(target=until_stdin_closes, daemon=True).start()
    sel = selectors.DefaultSelector()
    for i, (kind, s) in enumerate(socks):
        if kind != "unread":  # an unread answer is never read; its socket is polled below instead
            sel.register(s, selectors.EVENT_READ, i)
    while not done.is_set() and len(closed) < n:
        for key, _ in sel.select(0.05):
            try:
                if key.fileobj.recv(65536) == b"":  # type: ignore[union-attr]
                    raise ConnectionResetError
            except BlockingIOError:
                continue
            except OSError:
                note(key.data)
                sel.unregister(key.fileobj)
        for i, (kind, s) in enumerate(socks):
            if kind == "unread" and i not in closed and peer_closed(s):
                note(i)
    done.wait(60)
    for _, s in socks:
        s.close()


def peer_closed(s: socket.socket) -> bool:
    """Whether the server has closed `s`, without reading what it sent: the kernel reports the server's FIN (or
    reset) as POLLRDHUP/POLLHUP."""
    p = select.poll()
    p.register(s, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    return bool(p.poll(0))


if __name__ == "__main__":
    _attack(sys.argv[1], int(sys.argv[2]))
