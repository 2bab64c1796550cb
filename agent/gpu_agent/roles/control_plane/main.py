"""Running the reference control plane as a process (or inside `gpu-agent local`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from gpu_agent.foundations.config import LOGGING, Config, ConfigError, RoleConfig, Setting
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.secrets import Secret

if TYPE_CHECKING:
    from gpu_agent.roles.control_plane.server import ControlPlaneServer

log = get_logger(__name__)

STORE_SETTINGS = [
    Setting("database", "path", ".run/control-plane.sqlite", "SQLite database file (survives restarts)"),
    Setting("registrationToken", "secret", "", "token agents register with (env only; or registrationTokenFile)"),
    Setting("registrationTokenFile", "path", "", "file holding the registration token", optional=True),
    Setting("adminToken", "secret", "", "token for enqueueing work and fault injection (env only; or adminTokenFile)"),
    Setting("adminTokenFile", "path", "", "file holding the admin token", optional=True),
    Setting("credentialTtl", "seconds", 3600.0, "lifetime of an issued credential", 0.5, 86400 * 30),
    Setting("maxLeaseSeconds", "seconds", 300.0, "longest lease a consumer may ask for", 0.1, 86400),
    Setting("reregisterAfter", "seconds", 60.0, "re-registration interval suggested to agents", 1, 86400),
    Setting("maxLeaseWait", "seconds", 30.0, "longest a long-polled lease call is held", 0, 30),
    Setting("faultInjection", "bool", False, "serve /admin/faults, through which the admin token makes the next calls "
            "fail on purpose (a test facility; off: it answers 404)"),
]

SETTINGS = [
    *LOGGING,
    Setting("listenAddress", "address", "127.0.0.1:8700", "HOST:PORT to serve the API on"),
    *STORE_SETTINGS,
]


class ServerConfig(Config):
    """What a control plane's server is built from (the store settings, less the token files, which
    `load` has read into the tokens)."""
    database: str
    registrationToken: Secret
    adminToken: Secret
    credentialTtl: float
    maxLeaseSeconds: float
    reregisterAfter: float
    maxLeaseWait: float
    faultInjection: bool


class ControlPlaneConfig(ServerConfig, RoleConfig):
    """The settings above, typed (`Config.problems` holds the two to each other)."""
    listenAddress: str
    registrationTokenFile: str
    adminTokenFile: str


def build_server(cfg: ServerConfig, listen: str) -> ControlPlaneServer:
    # The server's models (pydantic) cost about 10 MiB: loaded only where a control plane runs,
    # never by the agents that merely share this command.
    from gpu_agent.roles.control_plane.server import ControlPlane, ControlPlaneServer, ServerSettings
    from gpu_agent.roles.control_plane.store import Store

    for name in ("registrationToken", "adminToken"):
        if not getattr(cfg, name):
            setting = next(x for x in SETTINGS if x.name == name)
            file_setting = next(x for x in SETTINGS if x.name == name + "File")
            raise ConfigError(f"{name} is required: set {setting.env} or {file_setting.flag}")
    store = Store(Path(cfg.database))
    cp = ControlPlane(store, ServerSettings(cfg.registrationToken, cfg.adminToken, cfg.credentialTtl,
                                            cfg.maxLeaseSeconds, cfg.reregisterAfter, cfg.maxLeaseWait,
                                            fault_injection=cfg.faultInjection))
    if cfg.faultInjection:
        log.warning("fault injection is on: the admin token can make calls fail through /admin/faults (a test facility)")
    host, _, port = listen.rpartition(":")
    return ControlPlaneServer(cp, host, int(port))
