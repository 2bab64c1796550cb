"""Runs last: no token, credential or Authorization header appears in any log the suite wrote."""

import re

import pytest

from tests.integration.harness import LOGS, SECRETS, Rig

pytestmark = pytest.mark.integration

# An issued credential is secrets.token_urlsafe(32): 43 URL-safe characters.
CREDENTIAL_SHAPE = re.compile(r"(?<![A-Za-z0-9_-])[A-Za-z0-9_-]{43}(?![A-Za-z0-9_-])")


def test_no_token_in_any_log(tmp_path):
    # Exercise every token-bearing path at the highest verbosity, so this test holds on its own too.
    rig = Rig(tmp_path)
    try:
        cp = rig.start_control_plane("--credential-ttl", "1", "-v", "7")
        reg = cp.register(rig.registration_token, "probe", 1, __import__("gpu_agent.foundations.gpus", fromlist=["Inventory"]).Inventory())
        SECRETS.append(reg.credential.token.reveal())
        cp.enqueue(rig.admin_token, "k", {})
        rig.set_gpus(1)
        rig.start_agent(verbosity=7)
        rig.wait_health(200, 5)
        cp.set_fault(rig.admin_token, mode="status", status=401, count=1, path="/v1/credentials/renew")
        import time

        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and not rig.agent.grep("renew"):
            time.sleep(0.05)
    finally:
        rig.stop()
    assert LOGS, "no logs were written"
    offenders = []
    for log in LOGS:
        text = log.read_text(errors="replace")
        for secret in SECRETS:
            if secret in text:
                offenders.append(f"{log}: contains a token")
        if "Bearer " in text:
            offenders.append(f"{log}: contains an Authorization header")
        for m in CREDENTIAL_SHAPE.finditer(text):
            offenders.append(f"{log}: credential-shaped string {m.group(0)[:4]}...")
    assert not offenders, offenders
