"""The driver's opaque device configurations, decoded strictly.

    apiVersion: gpu.gpu-agent.io/v1alpha1
    kind: GpuConfig
    sharing:
      strategy: TimeSlicing        # or Exclusive
      timeSlicingConfig: {interval: Default}   # Default | Short | Medium | Long

    apiVersion: gpu.gpu-agent.io/v1alpha1
    kind: ChannelConfig            # what a GPUDomain's channel ResourceClaimTemplate carries (the cluster agent's)
    domain: <GPUDomain name>       # in the claim's namespace
    domainUID: <its uid>           # optional: a domain deleted and made again under the name is another domain
    allocationMode: Single         # or All: every channel of the node's range

An unknown field, a wrong type or an unknown kind is a permanent error: retrying cannot fix a claim's
spec, so the kubelet is told at once and the pod's event names the field. The text is apimachinery's
(`strict decoding error: unknown field "sharing.foo"`), the one the DRA bats suite greps for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class PermanentError(Exception):
    """A prepare that cannot succeed however often it is retried (the claim's own content is wrong)."""


API_VERSION = "gpu.gpu-agent.io/v1alpha1"
KIND = "GpuConfig"
CHANNEL_KIND = "ChannelConfig"
KINDS = (KIND, CHANNEL_KIND)
ALLOCATION_MODES = ("Single", "All")
STRATEGIES = ("TimeSlicing", "Exclusive")
INTERVALS = ("Default", "Short", "Medium", "Long")

# field -> its type, or a nested schema
_SCHEMA: dict[str, Any] = {
    "apiVersion": str, "kind": str,
    "sharing": {"strategy": str, "timeSlicingConfig": {"interval": str}},
}
_CHANNEL_SCHEMA: dict[str, Any] = {"apiVersion": str, "kind": str, "domain": str, "domainUID": str, "allocationMode": str}


@dataclass(frozen=True)
class GpuConfig:
    strategy: str = "TimeSlicing"
    interval: str = "Default"

    def env(self) -> list[str]:
        return [f"GPU_AGENT_SHARING_STRATEGY={self.strategy}"] + (
            [f"GPU_AGENT_TIMESLICE_INTERVAL={self.interval}"] if self.strategy == "TimeSlicing" else [])


@dataclass(frozen=True)
class ChannelConfig:
    """A channel claim's: which GPUDomain the node joins for it, and whether it gets one channel or all of them."""
    domain: str
    domain_uid: str = ""
    allocation_mode: str = "Single"


Config = GpuConfig | ChannelConfig


def _unknown_fields(value: Any, schema: dict[str, Any], path: str, out: list[str], wrong: list[str]) -> None:
    for key, item in value.items():
        where = f"{path}.{key}" if path else key
        if key not in schema:
            out.append(f'unknown field "{where}"')
        elif isinstance(schema[key], dict):
            if not isinstance(item, dict):
                wrong.append(f"{where}: expected an object, got {type(item).__name__}")
            else:
                _unknown_fields(item, schema[key], where, out, wrong)
        elif not isinstance(item, schema[key]):
            wrong.append(f"{where}: expected a {schema[key].__name__}, got {type(item).__name__}")


def _strict(parameters: dict[str, Any], schema: dict[str, Any]) -> None:
    unknown: list[str] = []
    wrong: list[str] = []
    _unknown_fields(parameters, schema, "", unknown, wrong)
    if unknown:
        raise PermanentError(f"error decoding config parameters: strict decoding error: {', '.join(unknown)}")
    if wrong:
        raise PermanentError(f"error decoding config parameters: {'; '.join(wrong)}")


def decode(parameters: Any) -> Config:
    """A GpuConfig or ChannelConfig from an opaque config's parameters, or a PermanentError saying what is wrong and where."""
    if not isinstance(parameters, dict):
        raise PermanentError(f"error decoding config parameters: expected an object with apiVersion {API_VERSION} "
                             f"and kind {KIND}, got {type(parameters).__name__}")
    if parameters.get("apiVersion") != API_VERSION or parameters.get("kind") not in KINDS:
        raise PermanentError(f"error decoding config parameters: unknown type {parameters.get('apiVersion')!r}/"
                             f"{parameters.get('kind')!r}: this driver reads apiVersion {API_VERSION}, kind "
                             f"{' or '.join(KINDS)}")
    if parameters.get("kind") == CHANNEL_KIND:
        return _channel(parameters)
    _strict(parameters, _SCHEMA)
    sharing = parameters.get("sharing") or {}
    strategy = sharing.get("strategy", "TimeSlicing")
    if strategy not in STRATEGIES:
        raise PermanentError(f"invalid config: sharing.strategy {strategy!r}: one of {', '.join(STRATEGIES)}")
    interval = (sharing.get("timeSlicingConfig") or {}).get("interval", "Default")
    if interval not in INTERVALS:
        raise PermanentError(f"invalid config: sharing.timeSlicingConfig.interval {interval!r}: one of {', '.join(INTERVALS)}")
    if strategy != "TimeSlicing" and "timeSlicingConfig" in sharing:
        raise PermanentError(f"invalid config: sharing.timeSlicingConfig is only for strategy TimeSlicing, not {strategy}")
    return GpuConfig(strategy=strategy, interval=interval)


def _channel(parameters: dict[str, Any]) -> ChannelConfig:
    _strict(parameters, _CHANNEL_SCHEMA)
    domain = parameters.get("domain", "")
    if not domain:
        raise PermanentError("invalid config: ChannelConfig.domain is empty: name the GPUDomain whose channel this "
                             "claim asks for (the domain's own template sets it)")
    mode = parameters.get("allocationMode", "Single")
    if mode not in ALLOCATION_MODES:
        raise PermanentError(f"invalid config: ChannelConfig.allocationMode {mode!r}: one of {', '.join(ALLOCATION_MODES)}")
    return ChannelConfig(domain=domain, domain_uid=parameters.get("domainUID", ""), allocation_mode=mode)


def configs_for(allocation: dict[str, Any], driver: str) -> dict[str, Config]:
    """Each request's GpuConfig from a claim's `status.allocation.devices.config`: the class's configs
    first, then the claim's, the last match winning; an entry without `requests` matches every request.
    Returns {request: config}, with "" the config of a request no entry names."""
    entries = [c for c in (allocation.get("devices") or {}).get("config") or [] if (c.get("opaque") or {}).get("driver") == driver]
    entries.sort(key=lambda c: 0 if c.get("source") == "FromClass" else 1)  # stable: order within a source kept
    out: dict[str, Config] = {"": GpuConfig()}
    results = (allocation.get("devices") or {}).get("results") or []
    requests = {r.get("request", "").split("/")[0] for r in results}
    for entry in entries:
        config = decode((entry.get("opaque") or {}).get("parameters"))
        named = entry.get("requests") or []
        for request in requests if not named else {n.split("/")[0] for n in named}:
            out[request] = config
        if not named:
            out[""] = config
    return out
