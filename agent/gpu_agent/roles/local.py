"""`gpu-agent local`: the main job on one machine, no Kubernetes needed.

Starts the reference control plane and the cluster agent on loopback, with the fake GPU
source. Tokens are generated once into the state folder (mode 0600); the fake GPU state
file starts with zero GPUs, so the agent comes up live and NotReady, and a few demo work
items wait in the queue until `fake-gpu set --count 4` brings GPUs. That is graceful no-GPU
mode, so here `gracefulNoGPU` defaults to true (the cluster agent's own default is false:
it exits when it starts with no GPUs).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import sys
from dataclasses import replace
from pathlib import Path

from gpu_agent.foundations import fake_state
from gpu_agent.foundations.config import ConfigError, Setting
from gpu_agent.foundations.control_plane_client import ControlPlaneClient
from gpu_agent.foundations.gpus import Inventory
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.secrets import Secret
from gpu_agent.foundations.threads import in_daemon_thread
from gpu_agent.roles import cluster_agent
from gpu_agent.roles.control_plane.main import STORE_SETTINGS, ServerConfig, build_server

log = get_logger(__name__)

# The demo starts with no GPUs and waits for them: graceful no-GPU mode unless told otherwise.
GRACEFUL = replace(next(s for s in cluster_agent.SETTINGS if s.name == "gracefulNoGPU"), default=True)

SETTINGS = [
    *(GRACEFUL if s.name == GRACEFUL.name else s for s in cluster_agent.SETTINGS),
    *[s for s in STORE_SETTINGS if s.kind != "secret" and not s.name.endswith("TokenFile")],
    Setting("controlPlaneListen", "address", "127.0.0.1:8700", "HOST:PORT of the embedded control plane"),
    Setting("stateDir", "path", ".run", "folder for tokens, databases and the fake GPU state file"),
    Setting("demoItems", "int", 5, "demo work items enqueued at start (idempotent across restarts)", 0, 10000),
]


class LocalConfig(cluster_agent.ClusterAgentConfig, ServerConfig):
    """The settings above, typed. The control plane's tokens are no settings here: `run` makes them."""
    DERIVED = frozenset({"registrationToken", "adminToken"})
    controlPlaneListen: str
    stateDir: str
    demoItems: int


# Settings whose default lives in the state folder, with those defaults (the settings' own; the fake
# state file's is the path itself, since $FAKE_GPU_STATE_FILE already names a file of the user's choice).
DEFAULT_FILES = {**{s.name: s.default for s in SETTINGS if s.name in ("database", "executorJournal")},
                 "fakeGpuStateFile": fake_state.DEFAULT_PATH}


def _token(path: Path) -> Secret:
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32))
        return Secret(path.read_text().strip())
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"token file {path} cannot be created or read ({getattr(e, 'strerror', None) or e}); "
                          "point --state-dir at a writable folder") from None


def in_state_dir(cfg: LocalConfig) -> LocalConfig:
    """Files left at their defaults follow --state-dir, as its help says: tokens, both databases
    and the fake GPU state file."""
    state = Path(cfg.stateDir)
    if state == Path(".run"):
        return cfg
    moved = {name: str(state / Path(default).name) for name, default in DEFAULT_FILES.items()
             if getattr(cfg, name) == default}
    return cfg.replace(**moved)


def _command(name: str) -> str:
    """How to type one of this install's commands from the current folder: `.venv/bin/fake-gpu`
    after `make setup`, or the bare name when that resolves to this install anyway."""
    here = Path(sys.executable).parent / name
    if shutil.which(name) == str(here) or not here.exists():
        return name
    try:
        return str(here.relative_to(Path.cwd()))
    except ValueError:
        return str(here)


def banner(agent_url: str, control_plane_url: str, state: Path, fake_file: Path, default_fake_file: bool) -> str:
    fake_gpu = _command("fake-gpu") + ("" if default_fake_file else f" --state-file {fake_file}")
    gpu_agent = _command("gpu-agent")
    queue = "" if str(state) == ".run" else f" --admin-token-file {state / 'admin-token'}"
    queue += "" if control_plane_url == "http://127.0.0.1:8700" else f" --control-plane-url {control_plane_url}"
    return "\n".join([
        "",
        "gpu-agent local is up (Ctrl-C stops it). In a second terminal:",
        f"  agent           {agent_url}  (/livez /healthz /version /metrics)",
        f"  control plane   {control_plane_url}  (tokens: {state / 'admin-token'} for the queue, "
        f"{state / 'registration-token'} for agents)",
        f"  readiness       curl -s {agent_url}/healthz",
        f"  GPUs arrive     {fake_gpu} set --count 4",
        f"  GPUs leave      {fake_gpu} set --count 0",
        f"  list the queue  {gpu_agent} queue list{queue}",
        f"  enqueue work    {gpu_agent} queue add demo-9{queue}",
        "",
    ])


async def run(cfg: LocalConfig, stop: asyncio.Event) -> int:
    """Serve until `stop` is set; the process's exit code (the cluster agent's: see ClusterAgent.run)."""
    cfg = in_state_dir(cfg)
    state = Path(cfg.stateDir)
    registration_token = _token(state / "registration-token")
    admin_token = _token(state / "admin-token")
    fake_file = Path(cfg.fakeGpuStateFile)
    if cfg.gpuSource == "fake" and not fake_file.exists():  # noqa: ASYNC240 - once, before anything else runs
        fake_state.write_atomic(fake_file, fake_state.render(Inventory(), node="local"))
        log.info("created %s with 0 GPUs", fake_file)
    server = build_server(cfg.replace(registrationToken=registration_token, adminToken=admin_token),
                          cfg.controlPlaneListen)
    server.start()
    log.info("reference control plane serving HTTP on %s (admin token in %s)", server.url, state / "admin-token")
    try:
        client = ControlPlaneClient(server.url)
        for n in range(cfg.demoItems):
            await in_daemon_thread(client.enqueue, admin_token, f"demo-{n}", {"kind": "demo", "n": n})
        client.close()
        agent = cluster_agent.ClusterAgent(cfg.replace(controlPlaneUrl=server.url, controlPlaneToken=registration_token))

        async def announce() -> None:
            await agent.started.wait()
            text = banner(f"http://{agent.endpoints.address}", server.url, state, fake_file,
                          fake_file == fake_state.default_path())
            print(text, file=sys.stderr, flush=True)

        announcing = asyncio.create_task(announce())
        try:
            return await agent.run(stop)
        finally:
            announcing.cancel()
    finally:
        server.stop()
