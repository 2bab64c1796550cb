"""Runs last: no token, credential or Authorization header appears in any log the suite wrote."""

import re

import pytest

from gpu_agent.foundations.gpus import Inventory
from tests.integration.harness import LOGS, SECRETS, Rig, wait_until

pytestmark = pytest.mark.integration

# An issued credential is secrets.token_urlsafe(32): 43 URL-safe characters.
CREDENTIAL_SHAPE = re.compile(r"(?<![A-Za-z0-9_-])[A-Za-z0-9_-]{43}(?![A-Za-z0-9_-])")


def test_no_token_in_any_log(tmp_path):
    # Exercise every token-bearing path at the highest verbosity, so this test holds on its own too.
    rig = Rig(tmp_path)
    try:
        cp = rig.start_control_plane("--credential-ttl", "1", "-v", "7", faults=True)
        reg = cp.register(rig.registration_token, "probe", 1, Inventory())
        SECRETS.append(reg.credential.token.reveal())
        cp.enqueue(rig.admin_token, "k", {})
        rig.set_gpus(1)
        rig.start_agent("--registration-retry-initial", "1", verbosity=7)  # not the 0.1 s GPU poll interval
        rig.wait_health(200, 5)
        # A renewal answered 503 lets the 1 s credential expire before the retry (1 s less jitter), which the
        # control plane refuses (401, credential expired). Every token-bearing path has run once it has: a
        # renewal failed, one refused, then registering again.
        cp.set_fault(rig.admin_token, mode="status", status=503, count=1, path="/v1/credentials/renew")
        wait_until(lambda: rig.agent.grep("credential renewal refused .*expired"), 10, "a refused renewal")
        wait_until(lambda: len(rig.agent.grep("registered 1 GPUs")) >= 2, 10, "registration after the refusal")
        wait_until(lambda: rig.agent.grep("control plane: POST /v1/queue/lease"), 10, "a logged lease round trip")
    finally:
        rig.stop()
    assert rig.agent.log in LOGS and rig.cp.log in LOGS  # this test's own logs are among those checked
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
