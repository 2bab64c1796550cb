"""The chart tests need no cluster, only the tools ci/scripts/install-tools.sh caches (helm, kubeconform, checkov);
`make test` installs them before its unit stage. Run alone on a machine without them, these tests skip saying
which command brings them (and `make test` fails on any skip)."""

from __future__ import annotations

import pytest

from e2e.cluster import CI_TOOLS


def pytest_collection_modifyitems(config, items):
    import shutil

    missing = [t for t in ("helm", "kubeconform", "checkov") if not (CI_TOOLS / t).exists() and not shutil.which(t)]
    if not missing:
        return
    skip = pytest.mark.skip(reason=f"{', '.join(missing)} not found: run `bash ci/scripts/install-tools.sh` "
                                   f"(it caches them in {CI_TOOLS})")
    for item in items:
        if "charts/tests" in str(item.path):
            item.add_marker(skip)
