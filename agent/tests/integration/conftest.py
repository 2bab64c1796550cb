import pytest

from tests.integration.harness import Rig


@pytest.fixture
def rig(tmp_path, request):
    r = Rig(tmp_path)
    yield r
    r.stop()
    if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
        for log in sorted(tmp_path.glob("*.log")):
            print(f"\n===== {log.name} =====\n{log.read_text(errors='replace')[-6000:]}")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    setattr(item, "rep_" + rep.when, rep)
    return rep


def pytest_collection_modifyitems(session, config, items):
    """The secrets check greps every log the other tests wrote, so it runs last."""
    last = [i for i in items if "test_zz_secrets" in i.nodeid]
    for i in last:
        items.remove(i)
        items.append(i)
