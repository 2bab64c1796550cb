"""Running the reference control plane as a process (or inside `gpu-agent local`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, cast

from gpu_agent.foundations.config import LOGGING, Config, ConfigError, RoleConfig, Setting
from gpu_agent.foundations.http import TLSFiles
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.secrets import Secret
from gpu_agent.foundations.token_file import TokenFile

if TYPE_CHECKING:
    from gpu_agent.roles.control_plane.server import ControlPlaneServer

log = get_logger(__name__)

STORE_SETTINGS = [
    Setting("database", "path", ".run/control-plane.sqlite", "SQLite database file (survives restarts)"),
    Setting("registrationToken", "secret", "", "token agents register with (env only; or registrationTokenFile)"),
    Setting("registrationTokenFile", "path", "", "file holding the registration token; read again when it changes, "
            "the token it held still accepted for tokenOverlap", optional=True),
    Setting("adminToken", "secret", "", "token for enqueueing work and fault injection (env only; or adminTokenFile)"),
    Setting("adminTokenFile", "path", "", "file holding the admin token; read again when it changes, the token it "
            "held still accepted for tokenOverlap", optional=True),
    Setting("credentialTtl", "seconds", 3600.0, "lifetime of an issued credential", 0.5, 86400 * 30),
    Setting("credentialOverlap", "seconds", 60.0, "how long an agent's previous credential keeps working once a "
            "registration or renewal gave it a new one (its older ones stop at once)", 0, 3600),
    Setting("maxLeaseSeconds", "seconds", 300.0, "longest lease a consumer may ask for", 0.1, 86400),
    Setting("reregisterAfter", "seconds", 60.0, "re-registration interval suggested to agents", 1, 86400),
    Setting("maxLeaseWait", "seconds", 30.0, "longest a long-polled lease call is held", 0, 30),
    Setting("faultInjection", "bool", False, "serve /admin/faults, through which the admin token makes the next calls "
            "fail on purpose (a test facility; off: it answers 404)"),
]

SETTINGS = [
    *LOGGING,
    Setting("listenAddress", "address", "127.0.0.1:8700", "HOST:PORT to serve the API on"),
    # No TLS settings in `gpu-agent local`: it serves loopback only, where plain HTTP is what a newcomer's curl expects.
    Setting("tlsCertFile", "path", "", "PEM certificate (its chain after it) to serve HTTPS with, with tlsKeyFile; "
            "reloaded when it changes (unset: plain HTTP)", optional=True),
    Setting("tlsKeyFile", "path", "", "PEM private key (unencrypted) of tlsCertFile; reloaded when it changes",
            optional=True),
    *STORE_SETTINGS,
    # Not in `gpu-agent local`, whose tokens are its own and never change while it runs.
    Setting("tokenOverlap", "seconds", 600.0, "how long the token a token file held before it changed (a rotated "
            "Secret) is still accepted beside the new one, so that every client moves over without a refused call; "
            "0: refused at once", 0, 86400),
]


class ServerConfig(Config):
    """What a control plane's server is built from (the store settings, less the token files, which
    `load` has read into the tokens)."""
    database: str
    registrationToken: Secret
    adminToken: Secret
    credentialTtl: float
    credentialOverlap: float
    maxLeaseSeconds: float
    reregisterAfter: float
    maxLeaseWait: float
    faultInjection: bool


class ControlPlaneConfig(ServerConfig, RoleConfig):
    """The settings above, typed (`Config.problems` holds the two to each other)."""
    listenAddress: str
    tlsCertFile: str
    tlsKeyFile: str
    registrationTokenFile: str
    adminTokenFile: str
    tokenOverlap: float


def tls_files(cfg: ControlPlaneConfig) -> TLSFiles | None:
    """The certificate and key to serve HTTPS with, or None for plain HTTP; ConfigError when only one is set."""
    given = {name: getattr(cfg, name) for name in ("tlsCertFile", "tlsKeyFile")}
    if not any(given.values()):
        return None
    if not all(given.values()):
        (missing,) = (next(s for s in SETTINGS if s.name == name) for name, value in given.items() if not value)
        (present,) = (name for name, value in given.items() if value)
        raise ConfigError(f"{present} is set but {missing.name} is not: HTTPS needs both the certificate and its key; "
                          f"set {missing.flag} (or {missing.env}), or unset {present} to serve plain HTTP")
    return TLSFiles(cfg.tlsCertFile, cfg.tlsKeyFile)


def token_source(cfg: ServerConfig, name: str, overlap: float) -> Secret | TokenFile:
    """Setting `name`'s token: from its file, read again when that changes (the token it replaces accepted for
    `overlap`), or as given."""
    path = cfg.secret_file(name)
    if not path:
        return cast(Secret, getattr(cfg, name))
    flag = next(s for s in SETTINGS if s.name == name + "File").flag
    return TokenFile(path, name + "File", flag, overlap=overlap, initial=getattr(cfg, name))


def build_server(cfg: ServerConfig, listen: str, tls: TLSFiles | None = None,
                 token_overlap: float = 0.0) -> ControlPlaneServer:
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
    tokens = (token_source(cfg, "registrationToken", token_overlap), token_source(cfg, "adminToken", token_overlap))
    cp = ControlPlane(store, ServerSettings(*tokens, cfg.credentialTtl,
                                            cfg.maxLeaseSeconds, cfg.reregisterAfter, cfg.maxLeaseWait,
                                            fault_injection=cfg.faultInjection, credential_overlap=cfg.credentialOverlap))
    if cfg.faultInjection:
        log.warning("fault injection is on: the admin token can make calls fail through /admin/faults (a test facility)")
    host, _, port = listen.rpartition(":")
    return ControlPlaneServer(cp, host, int(port), tls=tls)


def serving(server: ControlPlaneServer, tls: TLSFiles | None) -> str:
    """What the start's log line says the control plane serves, and where."""
    if tls is None:
        return f"serving HTTP on {server.url}"
    return (f"serving HTTPS on {server.url} (certificate {tls.cert_file}, key {tls.key_file}, reloaded when they "
            "change)")
