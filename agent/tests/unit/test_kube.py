import threading

from kubernetes.client.exceptions import ApiException

from gpu_agent.foundations import kube


class Script:
    """A list call and a watch that follow a script. `lists`: what each list answers (an exception is raised);
    `watches`: for each watch, the events it streams then how it ends (None: a clean end, the server's timeout;
    an exception: raised). The last entry of either sets `stop` once reached, so the loop ends there."""

    def __init__(self, lists, watches):
        self.lists, self.watches = list(lists), list(watches)
        self.stop = threading.Event()
        self.calls, self.timeouts, self.pauses = [], [], []

    def list_call(self, ns, _request_timeout, **kwargs):
        self.timeouts.append(("list", _request_timeout))
        answer = self.lists.pop(0) if self.lists else self.exhausted("list")
        self.calls.append(("list", ns, kwargs))
        if not self.lists and not self.watches:
            self.stop.set()
        if isinstance(answer, Exception):
            raise answer
        return answer

    def exhausted(self, what):
        """A call past the script's end (the loop did more than the script foresaw): end the loop, say so."""
        self.stop.set()
        raise RuntimeError(f"script exhausted: an extra {what}")

    def watch(self):
        script = self

        class FakeWatch:
            resource_version = None

            def stream(self, fn, *args, resource_version, timeout_seconds, _request_timeout, **kwargs):
                script.timeouts.append(("watch", _request_timeout - timeout_seconds))
                script.calls.append(("watch", args, resource_version, kwargs))
                events, end = script.watches.pop(0) if script.watches else script.exhausted("watch")
                yield from events
                if not script.watches:
                    script.stop.set()
                if end is not None:
                    raise end

            def stop(self):
                pass
        return FakeWatch

    def run(self, monkeypatch):
        monkeypatch.setattr(kube.watch, "Watch", self.watch())
        seen, errors = [], []

        pauses = self.pauses

        class Clock:  # records the pauses instead of waiting
            def wait_blocking(self, stop, seconds):
                pauses.append(seconds)
        kube.list_then_watch(self.list_call, "ns1", label_selector="x=y",
                             on_list=lambda lst: seen.append(("list", kube.items_of(lst))),
                             on_event=lambda kind, obj: seen.append((kind, obj["metadata"]["name"])),
                             on_error=errors.append, stop=self.stop, retry_seconds=3, clock=Clock())
        return seen, [str(e) for e in errors]


def listed(version, *names):
    return {"metadata": {"resourceVersion": version}, "items": list(names)}


def event(kind, name, version):
    obj = {"metadata": {"name": name, "resourceVersion": version}}
    return {"type": kind, "object": obj, "raw_object": obj}


def bookmark(version):
    obj = {"kind": "Pod", "metadata": {"resourceVersion": version}}
    return {"type": "BOOKMARK", "object": obj, "raw_object": obj}


def test_a_watch_that_ends_resumes_from_the_last_version_seen_a_bookmarks_too_without_listing_again(monkeypatch):
    script = Script([listed("7", "a")], [
        ([event("ADDED", "b", "8"), event("MODIFIED", "a", "9")], None),  # the server's timeout ends it
        ([bookmark("15")], None),  # nothing changed; the bookmark moves the version on
        ([event("DELETED", "b", "16")], None)])
    seen, errors = script.run(monkeypatch)
    assert errors == [] and script.pauses == []
    assert seen == [("list", ["a"]), ("ADDED", "b"), ("MODIFIED", "a"), ("DELETED", "b")]  # no bookmark delivered
    assert [call[:3] for call in script.calls] == [("list", "ns1", {"label_selector": "x=y"}), ("watch", ("ns1",), "7"),
                                                   ("watch", ("ns1",), "9"), ("watch", ("ns1",), "15")]
    assert all(call[3] == {"label_selector": "x=y", "allow_watch_bookmarks": True} for call in script.calls[1:])
    # Every call bounded: a list by the request timeout, a watch a grace period beyond its server-side end.
    assert script.timeouts == [("list", kube.REQUEST_TIMEOUT)] + [("watch", kube.WATCH_GRACE)] * 3


def test_a_410_gone_lists_again_at_once_and_other_errors_are_reported_then_paused_before_a_list(monkeypatch):
    gone = ApiException(status=410, reason="Expired: too old resource version")
    script = Script([RuntimeError("apiserver down"), listed("7", "a"), listed("20", "a", "b"), listed("30", "b")], [
        ([event("ADDED", "b", "8")], gone),  # compacted while we watched: list at once, no error, no pause
        ([], ApiException(status=500, reason="etcd leader changed")),
        ([event("DELETED", "a", "31")], None)])
    seen, errors = script.run(monkeypatch)
    assert errors == ["apiserver down", "(500)\nReason: etcd leader changed\n"]
    assert script.pauses == [3, 3]
    assert seen == [("list", ["a"]), ("ADDED", "b"), ("list", ["a", "b"]), ("list", ["b"]), ("DELETED", "a")]
    assert [call[0] + ":" + str(call[2] if call[0] == "watch" else "") for call in script.calls] == [
        "list:", "list:", "watch:7", "list:", "watch:20", "list:", "watch:30"]


def test_a_410_on_the_version_just_listed_is_an_error_with_a_pause_not_a_tight_loop(monkeypatch):
    script = Script([listed("7", "a"), listed("8", "a")], [
        ([], ApiException(status=410, reason="Gone")), ([], None)])
    seen, errors = script.run(monkeypatch)
    assert errors == ["(410)\nReason: Gone\n"] and script.pauses == [3]
    assert seen == [("list", ["a"]), ("list", ["a"])]


def test_the_version_of_a_typed_event_is_read_from_its_metadata():
    from kubernetes import client
    pod = client.V1Pod(metadata=client.V1ObjectMeta(name="p", resource_version="12"))
    assert kube._event_version({"type": "MODIFIED", "object": pod}) == "12"
    assert kube._event_version({"type": "ERROR", "object": {"code": 410}}) is None


def test_a_stopped_caller_gets_no_more_events(monkeypatch):
    """An event that arrives after stop was set is not delivered (before, it was, and an EveryDomainAggregator
    stopped on losing leadership started a new Aggregator from it)."""
    script = Script([listed("7", "a")], [([event("ADDED", "b", "8"), event("ADDED", "c", "9")], None)])
    monkeypatch.setattr(kube.watch, "Watch", script.watch())
    seen = []

    def on_event(kind, obj):
        seen.append(obj["metadata"]["name"])
        script.stop.set()
    kube.list_then_watch(script.list_call, "ns1", on_list=lambda lst: None, on_event=on_event, on_error=print,
                         stop=script.stop)
    assert seen == ["b"]
