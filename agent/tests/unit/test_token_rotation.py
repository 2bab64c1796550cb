"""Tokens rotated without a restart (issue 48, part 4): a token file is read again when it changes; a file that
became empty or unreadable keeps the last good token with one warning; the reference control plane accepts the
token a change replaced for its overlap, then refuses it as any wrong token; the log redactor scrubs both during
the overlap and forgets the old one after it. Time is a hand-driven clock; the file is faked where its reads are
counted, and real (laid out as the kubelet lays out a Secret volume) where the swap itself is the point."""

from __future__ import annotations

import errno
import logging

import pytest

from gpu_agent.foundations import secrets, token_file
from gpu_agent.foundations.klog import ROOT
from gpu_agent.foundations.secrets import Redactor, Secret
from gpu_agent.foundations.token_file import FixedToken, TokenFile
from gpu_agent.roles.control_plane.server import ControlPlane, Refused, ServerSettings
from gpu_agent.roles.control_plane.store import Store
from tests.secret_volume import SecretVolume
from tests.unit.test_control_plane import INV
from tests.unit.test_registration_manager import inventory

OLD, NEW, NEWER = "old-token-0123456789abcdef", "new-token-0123456789abcdef", "newer-token-0123456789abcd"
OVERLAP = 600.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeFile:
    """A token file: its content (or the error reading it raises), a signature that changes with each write, and
    how many times it was read."""

    def __init__(self, content: str | Exception) -> None:
        self.content: str | Exception = content
        self.version = 1
        self.reads = 0

    def write(self, content: str | Exception) -> None:
        self.content = content
        self.version += 1

    def read(self, path: str) -> str:
        self.reads += 1
        if isinstance(self.content, Exception):
            raise self.content
        return self.content.strip()

    def stat(self, path: str) -> tuple[int, ...]:
        return (self.version,)


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def redactor(monkeypatch, clock):
    """A redactor on the hand-driven clock, in place of the process's (Secret registers with it)."""
    r = Redactor(monotonic=clock)
    monkeypatch.setattr(secrets, "REDACTOR", r)
    monkeypatch.setattr(token_file, "REDACTOR", r)
    return r


def token_file_of(f: FakeFile, clock: Clock, overlap: float = 0.0) -> TokenFile:
    return TokenFile("/secrets/registrationToken", "registrationTokenFile", "--registration-token-file",
                     overlap=overlap, clock=clock, read=f.read, stat=f.stat)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def caplog():
    """The agent's log records at INFO and above, whatever a test before left klog's root logger as (klog.setup
    stops it propagating to pytest's own caplog)."""
    root = logging.getLogger(ROOT)
    handler, level = Records(), root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield handler
    root.removeHandler(handler)
    root.setLevel(level)


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# ---- the helper --------------------------------------------------------------------------------------------------

def test_the_file_is_read_again_when_it_changes_and_only_then(clock, redactor):
    f = FakeFile(OLD)
    t = token_file_of(f, clock)
    assert t.current() == Secret(OLD) and f.reads == 1
    for _ in range(5):
        assert t.current().reveal() == OLD
    assert f.reads == 1  # unchanged: a stat per use, no read
    f.write(NEW)
    assert t.current().reveal() == NEW and f.reads == 2
    assert t.accepted() == (Secret(NEW),)  # a client's file has no overlap: the old token is gone at once


def test_an_empty_or_unreadable_file_keeps_the_last_good_token_with_one_warning_per_change(clock, redactor, caplog):
    f = FakeFile(OLD)
    t = token_file_of(f, clock)
    f.write("  \n")
    for _ in range(3):
        assert t.current().reveal() == OLD
    f.write(PermissionError(errno.EACCES, "Permission denied"))
    for _ in range(3):
        assert t.current().reveal() == OLD
    said = warnings(caplog)
    assert len(said) == 2, said  # one per change, however often it is used meanwhile
    assert "registrationTokenFile /secrets/registrationToken is empty: still using the token read before" in said[0]
    assert "cannot be read (Permission denied)" in said[1] and "--registration-token-file" in said[1]
    assert "without subPath" in said[0]  # the fix named
    assert not any(OLD in s for s in said)
    f.write(NEW)  # the Secret fixed: taken at once
    assert t.current().reveal() == NEW
    assert len(warnings(caplog)) == 2


def test_a_file_read_again_as_the_kubelet_swaps_a_secret_volume(tmp_path, clock, redactor):
    secret = SecretVolume(tmp_path / "tokens", {"registrationToken": OLD})
    t = TokenFile(str(secret.path("registrationToken")), "controlPlaneTokenFile", "--control-plane-token-file",
                  clock=clock)
    assert t.current().reveal() == OLD
    secret.update({"registrationToken": NEW})
    assert t.current().reveal() == NEW
    secret.update({"registrationToken": NEW})  # the same content in a new folder: nothing changes
    assert t.current().reveal() == NEW


def test_a_fixed_token_is_what_it_was_given():
    token = Secret(OLD)
    assert FixedToken(token).current() is token and FixedToken(token).accepted() == (token,)


# ---- the control plane's overlap ---------------------------------------------------------------------------------

def control_plane(tmp_path, clock, registration, admin) -> ControlPlane:
    return ControlPlane(Store(tmp_path / "cp.sqlite", clock), ServerSettings(registration, admin, 3600.0, 30.0, 60.0))


def accepted(cp: ControlPlane, token: str, kind: str) -> bool:
    try:
        cp.authorize(token, frozenset({kind}))
    except Refused as e:
        assert e.status == 401, e
        return False
    return True


def test_the_control_plane_accepts_the_replaced_token_for_its_overlap_then_refuses_it(tmp_path, clock, redactor):
    reg, adm = FakeFile(OLD), FakeFile("admin-old-0123456789abcdef")
    cp = control_plane(tmp_path, clock, token_file_of(reg, clock, OVERLAP), token_file_of(adm, clock, OVERLAP))
    assert accepted(cp, OLD, "registration") and not accepted(cp, NEW, "registration")
    reg.write(NEW)
    adm.write("admin-new-0123456789abcdef")
    assert accepted(cp, NEW, "registration") and accepted(cp, OLD, "registration")
    assert accepted(cp, "admin-new-0123456789abcdef", "admin") and accepted(cp, "admin-old-0123456789abcdef", "admin")
    clock.now += OVERLAP - 1
    assert accepted(cp, OLD, "registration") and accepted(cp, "admin-old-0123456789abcdef", "admin")
    clock.now += 1
    assert not accepted(cp, OLD, "registration") and not accepted(cp, "admin-old-0123456789abcdef", "admin")
    assert accepted(cp, NEW, "registration") and accepted(cp, "admin-new-0123456789abcdef", "admin")
    cp.store.close()


def test_a_registration_with_the_replaced_token_is_told_apart_in_the_log(tmp_path, clock, redactor, caplog):
    from gpu_agent.roles.control_plane import api

    reg = FakeFile(OLD)
    cp = control_plane(tmp_path, clock, token_file_of(reg, clock, OVERLAP), Secret("admin-0123456789abcdef"))
    reg.write(NEW)
    body = api.RegisterRequest.model_validate({"clusterId": "c1", "generation": 1, "gpus": [g.to_json() for g in INV.gpus]})
    assert cp.register(body, OLD)[0] == 200
    assert cp.register(body, NEW)[0] == 200
    said = [r.getMessage() for r in caplog.records if "registered" in r.getMessage()]
    assert "with the previous registration token" in said[0] and "previous" not in said[1], said
    cp.store.close()


def test_a_second_change_within_the_overlap_drops_the_first_token_at_once(tmp_path, clock, redactor):
    reg = FakeFile(OLD)
    cp = control_plane(tmp_path, clock, token_file_of(reg, clock, OVERLAP), Secret("admin-0123456789abcdef"))
    reg.write(NEW)
    assert accepted(cp, NEW, "registration") and accepted(cp, OLD, "registration")
    clock.now += 10
    reg.write(NEWER)
    assert accepted(cp, NEWER, "registration") and accepted(cp, NEW, "registration")
    assert not accepted(cp, OLD, "registration")


def test_an_overlap_of_0_refuses_the_replaced_token_at_once(tmp_path, clock, redactor):
    reg = FakeFile(OLD)
    cp = control_plane(tmp_path, clock, token_file_of(reg, clock, 0.0), Secret("admin-0123456789abcdef"))
    reg.write(NEW)
    assert accepted(cp, NEW, "registration") and not accepted(cp, OLD, "registration")


# ---- the redactor ------------------------------------------------------------------------------------------------

def test_the_redactor_scrubs_both_tokens_during_the_overlap_and_forgets_the_old_one_after(clock, redactor):
    reg = FakeFile(OLD)
    t = token_file_of(reg, clock, OVERLAP)
    line = f"a line naming {OLD} and {NEW}"
    assert redactor.scrub(line) == f"a line naming <redacted> and {NEW}"
    reg.write(NEW)
    t.accepted()
    assert redactor.scrub(line) == "a line naming <redacted> and <redacted>"
    clock.now += OVERLAP + secrets.RETIRED_GRACE_SECONDS - 1  # accepted no longer, still within the grace
    assert t.accepted() == (Secret(NEW),)
    assert redactor.scrub(line) == "a line naming <redacted> and <redacted>"
    clock.now += 1
    assert OLD not in redactor and NEW in redactor
    assert redactor.scrub(line) == f"a line naming {OLD} and <redacted>"


def test_a_clients_replaced_token_is_forgotten_after_the_grace_alone(clock, redactor):
    reg = FakeFile(OLD)
    t = token_file_of(reg, clock)
    reg.write(NEW)
    t.current()
    assert redactor.forgets_at(OLD) == clock.now + secrets.RETIRED_GRACE_SECONDS
    assert redactor.forgets_at(NEW) is None and NEW in redactor  # the token in use: kept for ever


def test_retire_leaves_a_value_it_does_not_keep_alone(clock):
    r = Redactor(monotonic=clock)
    r.retire("never-registered-0123456789")
    assert len(r) == 0


# ---- the cluster agent's registrations ---------------------------------------------------------------------------

async def test_the_agents_next_registration_presents_the_new_token(harness, clock, redactor):
    reg = FakeFile(OLD)
    async with harness(reregister=30.0) as h:
        h.manager.token = token_file_of(reg, clock)
        await h.manager.gpus_changed(1, inventory(1))
        await h.clock.advance(1)
        reg.write(NEW)
        await h.clock.advance(30)
        tokens = [identity[0].reveal() for identity in h.cp.identities]
    assert tokens == [OLD, NEW], tokens


@pytest.fixture
def harness(fixed_random):
    from tests.unit.test_registration_manager import Harness

    def make(**settings):
        return Harness(rng=fixed_random([]), **settings)
    return make


# ---- which tokens are read again: those from a file ----------------------------------------------------------------

def test_a_token_from_its_file_is_read_again_and_one_from_the_environment_is_fixed(tmp_path, redactor):
    import argparse

    from gpu_agent.foundations.config import load
    from gpu_agent.roles.control_plane.main import SETTINGS, ControlPlaneConfig, token_source

    (tmp_path / "reg").write_text(OLD)
    files = {"GPU_AGENT_REGISTRATION_TOKEN_FILE": str(tmp_path / "reg"), "GPU_AGENT_ADMIN_TOKEN": "admin-0123456789abc"}
    cfg = load(SETTINGS, argparse.Namespace(), files, as_=ControlPlaneConfig)
    assert cfg.secret_file("registrationToken") == str(tmp_path / "reg") and cfg.secret_file("adminToken") == ""
    source = token_source(cfg, "registrationToken", OVERLAP)
    assert isinstance(source, TokenFile) and source.overlap == OVERLAP
    assert isinstance(token_source(cfg, "adminToken", OVERLAP), Secret)
    # The environment wins over the file, as it always did: then nothing is read again.
    both = load(SETTINGS, argparse.Namespace(), {**files, "GPU_AGENT_REGISTRATION_TOKEN": NEW}, as_=ControlPlaneConfig)
    assert both.secret_file("registrationToken") == "" and token_source(both, "registrationToken", 1) == Secret(NEW)
    # A token the role sets itself (gpu-agent local) is no file's.
    assert cfg.replace(registrationToken=Secret(NEW)).secret_file("registrationToken") == ""
