"""A stopped watch ends at once (foundations/kube.py's `list_then_watch`, with a `StopEvent`), against a real local
HTTP server and a real ApiClient: the server answers the list, then opens the watch's chunked response and sends
nothing more (a quiet stream: no events, no bookmark), holding it open. Before, the watch's thread checked its stop
only between events, so it stayed blocked in the read until the next event or the server's timeout (minutes); now
setting the stop shuts the watch's connection down from the stopping side, the read returns, and the thread ends
without reporting that deliberate end as an error."""

import json
import threading
import time
from urllib.parse import parse_qs, urlsplit

import pytest
from kubernetes import client

from gpu_agent.foundations.kube import api_client, core_v1_list, list_then_watch
from gpu_agent.foundations.threads import StopEvent
from tests.loopback_kubeconfig import LoopbackApiServer, QuietHandler

POD = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ns", "resourceVersion": "5"}}
ADDED = {"type": "ADDED", "object": {**POD, "metadata": {**POD["metadata"], "name": "q", "resourceVersion": "8"}}}


class QuietApiServer(LoopbackApiServer):
    """Answers a Pod list; a Pod watch gets its headers and `events`, then nothing more, its connection held open
    until `close` (as an API server's watch on a quiet collection between bookmarks). `headers`: cleared, the
    watch's headers wait until it is set (a stop set while the watch request is still in flight)."""

    def __init__(self, events=(ADDED,)) -> None:
        self.requests: list[str] = []
        self.watching = threading.Event()  # a watch request arrived
        self.headers = threading.Event()
        self.headers.set()
        self.released = threading.Event()  # set by close: the held watch responses end
        server = self

        class Handler(QuietHandler):
            protocol_version = "HTTP/1.1"  # chunked transfer, as the API server's watch responses

            def do_GET(self) -> None:  # noqa: N802 - http.server calls it by this name
                url = urlsplit(self.path)
                query = parse_qs(url.query)
                if url.path != "/api/v1/namespaces/ns/pods":
                    self.send_error(404)
                    return
                if query.get("watch") == ["true"]:
                    server.requests.append("watch " + query["resourceVersion"][0])
                    server.watching.set()
                    server.headers.wait(10)
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for event in events:
                        line = json.dumps(event).encode() + b"\n"
                        self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                    self.wfile.flush()
                    server.released.wait(30)  # quiet: nothing more until the test ends
                    self.close_connection = True
                    return
                server.requests.append("list")
                self.send_json(json.dumps({"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "7"},
                                           "items": [POD]}).encode())

        self.serve(Handler)

    def close(self) -> None:
        self.headers.set()
        self.released.set()
        super().close()


@pytest.fixture
def servers():
    made = []

    def make(**kwargs):
        made.append(QuietApiServer(**kwargs))
        return made[-1]
    yield make
    for s in made:
        s.close()


def watch_on_a_thread(list_call, stop):
    """Run list_then_watch on a thread as the agents do; what it delivered and reported."""
    seen, errors = [], []
    thread = threading.Thread(target=lambda: list_then_watch(
        list_call, "ns", on_list=lambda listed: seen.append("list"),
        on_event=lambda kind, obj: seen.append((kind, obj)), on_error=errors.append, stop=stop,
        retry_seconds=0.05, resync_seconds=240), name="test-watch", daemon=True)
    thread.start()
    return thread, seen, errors


def wait_for(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


@pytest.mark.parametrize("typed", [False, True], ids=["lean-list", "generated-api"])
def test_a_stopped_watch_on_a_quiet_stream_ends_at_once_and_reports_no_error(servers, tmp_path, typed):
    server = servers()
    api = api_client(server.kubeconfig(tmp_path), limit=None)
    list_call = client.CoreV1Api(api).list_namespaced_pod if typed else core_v1_list(api, "pods")
    stop = StopEvent()
    thread, seen, errors = watch_on_a_thread(list_call, stop)
    assert wait_for(lambda: len(seen) == 2), seen  # listed, then the one event: the thread now blocks in its read
    time.sleep(0.2)  # and stays there: the stream is quiet
    assert thread.is_alive()

    started = time.monotonic()
    stop.set()
    thread.join(2.0)
    took = time.monotonic() - started
    assert not thread.is_alive(), f"the watch's thread still runs {took:.1f}s after its stop was set"
    assert errors == []  # the stop's own close of the connection is no error
    assert server.requests == ["list", "watch 7"]  # and no list or watch again after it
    kind, obj = seen[1]
    # The event still comes typed from a generated API method (its return type read through the wrapper), plain
    # from the lean list.
    assert kind == "ADDED" and (obj.metadata.name if typed else obj["metadata"]["name"]) == "q"


def test_a_stop_set_while_the_watch_request_is_in_flight_ends_the_watch_once_it_is_answered(servers, tmp_path):
    """The stop came before the response it would shut down existed: it is shut down as soon as it does (the
    stream is quiet from its start: no event would wake the thread)."""
    server = servers(events=())
    server.headers.clear()
    stop = StopEvent()
    thread, seen, errors = watch_on_a_thread(core_v1_list(api_client(server.kubeconfig(tmp_path), limit=None), "pods"),
                                             stop)
    assert server.watching.wait(5)
    stop.set()
    time.sleep(0.1)
    server.headers.set()  # answered now, then quiet
    thread.join(2.0)
    assert not thread.is_alive()
    assert errors == [] and seen == ["list"]
    assert server.requests == ["list", "watch 7"]


def test_a_stop_event_runs_what_was_registered_once_when_set_at_once_when_already_set_and_not_once_taken_back():
    stop, ran = StopEvent(), []
    stop.on_set(lambda: ran.append("a"))
    take_back = stop.on_set(lambda: ran.append("b"))
    take_back()
    assert ran == []
    stop.set()
    stop.set()
    assert ran == ["a"] and stop.is_set()
    stop.on_set(lambda: ran.append("c"))  # already set: runs now
    assert ran == ["a", "c"]
    stop.on_set(lambda: 1 / 0)  # a failing one does not fail its registration or the stop (it is logged)
    assert stop.wait(0)
