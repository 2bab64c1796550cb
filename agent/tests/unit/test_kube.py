import threading

from gpu_agent.foundations import kube


def test_list_then_watch_lists_watches_from_the_lists_version_and_lists_again_after_an_error(monkeypatch):
    stop = threading.Event()
    seen, errors, watched_from, timeouts = [], [], [], []
    lists = iter([RuntimeError("apiserver down"), {"metadata": {"resourceVersion": "7"}, "items": ["a"]},
                  {"metadata": {"resourceVersion": "9"}, "items": ["a", "b"]}])

    def list_call(ns, _request_timeout, **kwargs):
        timeouts.append(("list", _request_timeout))
        item = next(lists)
        if isinstance(item, Exception):
            raise item
        return item

    class FakeWatch:
        def stream(self, fn, *args, resource_version, timeout_seconds, _request_timeout, **kwargs):
            timeouts.append(("watch", _request_timeout - timeout_seconds))
            watched_from.append((args, resource_version, kwargs))
            if resource_version == "7":
                yield {"type": "ADDED", "object": "b"}
            else:
                stop.set()
                yield {"type": "DELETED", "object": "a"}

        def stop(self):
            pass

    monkeypatch.setattr(kube.watch, "Watch", FakeWatch)
    kube.list_then_watch(list_call, "ns1", label_selector="x=y", on_list=lambda lst: seen.append(("list", kube.items_of(lst))),
                         on_event=lambda kind, obj: seen.append((kind, obj)), on_error=errors.append, stop=stop,
                         retry_seconds=0)
    assert [str(e) for e in errors] == ["apiserver down"]
    # The DELETED event arrives after stop was set: a stopped caller gets nothing more (before, it did,
    # and an EveryDomainAggregator stopped on losing leadership started a new Aggregator from it).
    assert seen == [("list", ["a"]), ("ADDED", "b"), ("list", ["a", "b"])]
    assert watched_from == [(("ns1",), "7", {"label_selector": "x=y"}), (("ns1",), "9", {"label_selector": "x=y"})]
    # Every call bounded: a list by the request timeout, a watch a grace period beyond its server-side end.
    assert timeouts == [("list", kube.REQUEST_TIMEOUT)] * 2 + [("watch", kube.WATCH_GRACE), ("list", kube.REQUEST_TIMEOUT),
                                                                ("watch", kube.WATCH_GRACE)]
