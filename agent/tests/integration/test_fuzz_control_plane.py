"""schemathesis against the running control plane, with each of its three tokens and without one.

The OpenAPI document is generated from the same models the server validates with, so this checks
the server against its own promises: no 5xx, only documented statuses and content types, responses
that match their schemas, schema-valid requests accepted, schema-invalid ones refused, auth that
cannot be skipped. The main server runs without fault injection, so /admin/faults answers its
documented 404 there; it is fuzzed armed on a server of its own with fault injection on (arming faults on
the main one would make every later call fail on purpose). Real HTTP on loopback.
`FUZZ_EXAMPLES` sets examples per operation (the test command's default is small; `make fuzz`
raises it).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import requests

from gpu_agent.foundations.gpus import Inventory
from tests.integration.harness import Rig

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "15"))
ST = shutil.which("st", path=str(Path(sys.executable).parent)) or shutil.which("st")


def schemathesis(location: str, token: str | None, *extra: str) -> tuple[int, int, str]:
    """(exit code, cases generated, output tail) of one run against the schema at `location`."""
    argv = [ST, "run", location, "-n", str(EXAMPLES), "--checks", "all", "--no-color",
            "--generation-database", "none", "--seed", os.environ.get("FUZZ_SEED", "7"), *extra]
    if token:
        argv += ["-H", f"Authorization: Bearer {token}"]
    # schemathesis keeps a cache folder (.schemathesis/) in its working directory: not in the checkout.
    out = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=tempfile.gettempdir())
    text = out.stdout + out.stderr
    m = re.search(r"(\d+) generated", text)
    return out.returncode, int(m.group(1)) if m else 0, text[-4000:]


@pytest.fixture
def served(tmp_path):
    rig = Rig(tmp_path)
    client = rig.start_control_plane("--max-lease-wait", "0.2", "--credential-ttl", "3600")
    yield rig, client
    rig.stop()


def test_schemathesis_finds_no_failure_with_any_token_or_none(served, tmp_path):
    assert ST, "schemathesis (a dev dependency) is missing: run make setup"
    rig, client = served
    credential = client.register(rig.registration_token, "fuzz", 1, Inventory()).credential.token.reveal()
    # The document needs a token; save it once so the run without a token can read it from a file.
    doc = requests.get(rig.cp_url + "/openapi.json", headers={"Authorization": f"Bearer {rig.admin_token.reveal()}"},
                       timeout=5).text
    (tmp_path / "openapi.json").write_text(doc)
    runs = {
        "admin": (rig.admin_token.reveal(), []),
        "registration": (rig.registration_token.reveal(), []),
        # renewing revokes the credential the run is using; renewal itself takes no body
        "credential": (credential, ["--exclude-path", "/v1/credentials/renew"]),
    }
    results = {}
    for name, (token, extra) in runs.items():
        results[name] = schemathesis(f"{rig.cp_url}/openapi.json", token, *extra)
    results["none"] = schemathesis(str(tmp_path / "openapi.json"), None, "--url", rig.cp_url)
    print("\nschemathesis: " + ", ".join(f"{k}: {v[1]} cases, exit {v[0]}" for k, v in results.items()))
    for name, (code, cases, tail) in results.items():
        assert cases >= 50, f"{name}: only {cases} cases ran\n{tail}"
        assert code == 0, f"schemathesis with the {name} token found failures:\n{tail}"
    assert rig.cp.alive()
    assert not rig.cp.grep("Traceback"), "the control plane logged a traceback"


def test_schemathesis_on_fault_injection_alone(tmp_path):
    assert ST, "schemathesis (a dev dependency) is missing: run make setup"
    rig = Rig(tmp_path)
    rig.start_control_plane(faults=True)
    try:
        code, cases, tail = schemathesis(f"{rig.cp_url}/openapi.json", rig.admin_token.reveal(),
                                   "--include-path", "/admin/faults")
        print(f"\nschemathesis /admin/faults: {cases} cases, exit {code}")
        assert cases >= 20 and code == 0, tail
        assert not rig.cp.grep("Traceback")
    finally:
        rig.stop()
