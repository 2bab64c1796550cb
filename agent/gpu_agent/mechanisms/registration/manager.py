"""The registration manager: from "the cluster has GPUs" to "credentials installed".

Three loops share one `Gate`, held from capturing the inventory to applying the response:

  recovery   registers when the GPU generation has no registration yet ("initial" the first time);
             failures back off
             exponentially with jitter, capped; the backoff resets on success and on every
             GPU change (which also cuts a pending retry sleep short);
  periodic   re-registers every `reregistrationInterval` while registered;
  renewal    renews the credential before it expires; an expired credential drops readiness
             until renewed, and a credential the control plane refuses means register again.

A registration response is applied only if the GPU generation is still the one it was
captured at; otherwise it is discarded and recovery runs again for the new generation.
Readiness (the `registration` and `credentials` health entries, and the queue switch) is
recomputed from state in one place, `_publish()`, after every change.

Only healthy GPUs count: the control plane is told of the healthy GPUs of the current generation
(a GPU's health changing is a new generation), and an inventory with none healthy is handled as
no GPUs at all (nothing registered, NotReady, queues paused), with a reason that names each GPU
that is not healthy and why.

Large clusters: one registration lists at most MAX_REGISTERED_GPUS (16,384, the reference control
plane's MAX_GPUS). A cluster with more healthy GPUs registers the first 16,384 of them in the
inventory's order (by node name, then index) and its whole count in `gpuCount`, so the control
plane's view stays true: /v1/status shows the cluster's gpuCount and how many of them it lists
(gpusListed). Splitting the list over several calls would need the API to stitch parts into one
registration (one generation, one credential), which it does not; a control plane of before
gpuCount ignores the field and counts the list. /healthz says so once registered ("20000 GPUs,
the first 16384 listed"), and the work queue is unaffected: the agent sizes its work by its own
inventory, never by the control plane's list.

A registration refused for its size (413 from a control plane whose body limit is smaller than
this agent's payload, or its GPU list refused for its length: `TooLarge`) puts the control plane's
words, the GPUs listed and the bytes sent in the `registration` reason, and is retried on the same
capped backoff as any failure: a limit does not change between attempts, so a hot retry would only
load the control plane.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from gpu_agent.foundations.backoff import Backoff
from gpu_agent.foundations.clock import Clock, sleep_or
from gpu_agent.foundations.control_plane_client import (
    MAX_REGISTERED_GPUS,
    ControlPlaneClient,
    ControlPlaneError,
    Credential,
    Registration,
    Unauthorized,
)
from gpu_agent.foundations.gate import Gate
from gpu_agent.foundations.gpus import Inventory, describe_unhealthy
from gpu_agent.foundations.health import HealthRegistry
from gpu_agent.foundations.klog import get_logger
from gpu_agent.foundations.metrics import AgentMetrics
from gpu_agent.foundations.secrets import Secret
from gpu_agent.foundations.threads import in_daemon_thread
from gpu_agent.foundations.token_file import TokenSource, as_source

log = get_logger(__name__)

# Renew when this fraction of a credential's lifetime has passed, if the interval is longer.
RENEW_AT_LIFETIME_FRACTION = 0.8



class Outcome(StrEnum):
    """What one registration or renewal did (a failed call raises instead)."""
    OK = "ok"
    SKIPPED = "skipped"
    STALE = "stale"
    REFUSED = "refused"


@dataclass(frozen=True)
class RegistrationSettings:
    cluster_id: str
    retry_initial: float
    retry_max: float
    retry_jitter: float
    reregistration_interval: float
    renew_interval: float
    # The agent's identity, named in each registration: the control plane retires this agent's earlier credentials
    # (at most two of them work at once), never those of another replica of the same cluster.
    holder: str | None = None


class RegistrationManager:
    def __init__(self, client: ControlPlaneClient, token: Secret | TokenSource, *, settings: RegistrationSettings, clock: Clock,
                 rng: random.Random, health: HealthRegistry, metrics: AgentMetrics, gate: Gate,
                 on_readiness: Callable[[bool, str], Awaitable[None]],
                 offload: Callable[..., Awaitable[Any]] = in_daemon_thread) -> None:
        self.client = client
        self._offload = offload  # how blocking client calls leave the event loop; tests run them inline
        # The registration token, read again from its file at each registration when it changed (rotated without
        # a restart: foundations/token_file.py).
        self.token = as_source(token)
        self.settings = settings
        self.clock = clock
        self.health = health
        self.metrics = metrics
        self.gate = gate
        self.on_readiness = on_readiness
        self.backoff = Backoff(settings.retry_initial, settings.retry_max, 2.0, settings.retry_jitter, rng)
        self.renew_backoff = Backoff(settings.retry_initial, settings.retry_max, 2.0, settings.retry_jitter, rng)
        self.generation = 0
        self.inventory = Inventory()
        self.registered_generation: int | None = None
        self.registered_listed = 0  # of the GPUs registered, how many the registration listed (the rest in gpuCount)
        self.registered_count = 0
        self.registration_id: str | None = None
        self.credential: Secret | None = None
        self.credential_lifetime = 0.0
        self.credential_installed_at = 0.0
        self.renew_due_at = float("inf")
        self.last_error: str | None = None
        self.next_retry_in: float | None = None
        self._gpu_changed = asyncio.Event()
        self._credential_changed = asyncio.Event()
        self._ready: bool | None = None

    # ---- state ---------------------------------------------------------------------------------

    @property
    def registered(self) -> bool:
        return self.has_work_gpus and self.registered_generation == self.generation

    @property
    def has_work_gpus(self) -> bool:
        """Whether the inventory has a GPU that can take work (a healthy one)."""
        return bool(self.inventory.healthy)

    @property
    def credential_valid(self) -> bool:
        return self.credential is not None and self.clock.monotonic() < self.credential_expires_at

    @property
    def credential_expires_at(self) -> float:
        return self.credential_installed_at + self.credential_lifetime

    def current_credential(self) -> Secret | None:
        return self.credential if self.credential_valid else None

    async def _publish(self) -> None:
        if self.inventory.count == 0:
            reg = (False, "no GPUs available in cluster: registration deferred until GPUs appear")
        elif not self.has_work_gpus:
            reg = (False, f"no healthy GPU: {describe_unhealthy(self.inventory.unhealthy)}; "
                          "registration deferred until one is healthy")
        elif self.registered:
            listed = (f"; {self.registered_count} GPUs, the first {self.registered_listed} listed: the most one "
                      "registration lists" if self.registered_listed < self.registered_count else "")
            reg = (True, f"registered (generation {self.generation}{listed})")
        else:
            why = f"; last attempt failed: {self.last_error}" if self.last_error else ""
            retry = f"; next attempt in {self.next_retry_in:.1f}s" if self.next_retry_in is not None else ""
            reg = (False, f"waiting for successful registration after GPU discovery (generation {self.generation}){why}{retry}")
        self.health.set("registration", *reg, generation=self.generation, attempt=self.backoff.attempt)
        if self.credential is None:
            cred = (False, "no credentials installed")
        elif self.credential_valid:
            cred = (True, f"credential valid for {self.credential_expires_at - self.clock.monotonic():.0f}s")
        else:
            cred = (False, "credential expired: queues paused until it is renewed")
        self.health.set("credentials", *cred)
        ready = reg[0] and cred[0]
        reason = "ready" if ready else (reg[1] if not reg[0] else cred[1])
        if ready != self._ready:
            self._ready = ready
            await self.on_readiness(ready, reason)

    # ---- inputs --------------------------------------------------------------------------------

    async def gpus_changed(self, generation: int, inventory: Inventory) -> None:
        self.generation = generation
        self.inventory = inventory
        self.backoff.reset()
        self.next_retry_in = None
        self.last_error = None
        self.metrics.backoff.set(0)
        self._gpu_changed.set()
        await self._publish()

    async def _drop_credentials(self, register_at_once: bool) -> None:
        """Forget the credential and the registration it came with; readiness drops. With
        `register_at_once` the recovery loop registers again now instead of after its backoff."""
        self.credential = None
        self.registered_generation = None
        if register_at_once:
            self._gpu_changed.set()
        await self._publish()

    async def credential_refused(self) -> None:
        """A queue call was answered 401/403: the credential is no longer good."""
        if self.credential is not None:
            log.warning("control plane refused the credential: registering again")
            await self._drop_credentials(register_at_once=True)

    # ---- the one gated step: capture, call, check generation, apply -------------------------

    async def register(self, kind: str) -> Outcome:
        """OK, SKIPPED (no GPUs, or registered already when `kind` only fills a gap) or STALE (the GPUs
        changed while the call was out); a call that fails raises its ControlPlaneError."""
        async with self.gate.hold(kind):
            generation = self.generation
            # What the control plane is told of: the GPUs that can take work.
            inventory = Inventory(self.inventory.healthy, self.inventory.clique, self.inventory.fabric)
            if inventory.count == 0 or (kind in ("initial", "recovery") and self.registered):
                return Outcome.SKIPPED
            self.metrics.registration_attempts.labels(kind).inc()
            count = inventory.count
            if count > MAX_REGISTERED_GPUS:
                inventory = Inventory(inventory.gpus[:MAX_REGISTERED_GPUS], inventory.clique, inventory.fabric)
            log.v(2, "registering %d GPUs (generation %d, %s)%s", count, generation, kind,
                  f", listing the first {inventory.count}" if inventory.count < count else "")
            try:
                reg = await self._offload(self._register_call, generation, inventory, count)
            except ControlPlaneError as e:
                self.metrics.registration_failures.labels(kind, e.kind).inc()
                self.last_error = str(e)
                if isinstance(e, Unauthorized):
                    # The registration token itself is refused: nothing we hold is valid any more.
                    await self._drop_credentials(register_at_once=False)
                else:
                    await self._publish()
                raise
            if self.generation != generation:
                self.metrics.registration_discarded.inc()
                log.warning("discarding registration response for GPU generation %d: the GPUs changed meanwhile "
                            "(now generation %d); registering again", generation, self.generation)
                return Outcome.STALE
            self._install(reg.credential)
            self.registration_id = reg.registration_id
            self.registered_generation = generation
            self.registered_count, self.registered_listed = count, inventory.count
            self.last_error = None
            self.next_retry_in = None
            unhealthy = len(self.inventory.unhealthy)
            log.info("registered %d GPUs with the control plane (generation %d, %s)%s%s", count, generation, kind,
                     f"; the first {inventory.count} listed, the most one registration lists" if inventory.count < count
                     else "", f"; {unhealthy} not healthy left out" if unhealthy else "")
            await self._publish()
            return Outcome.OK

    async def renew(self) -> Outcome:
        """OK, SKIPPED (no credential to renew), REFUSED (the control plane refused it: registering
        again) or STALE (a registration installed a newer one meanwhile); any other failure raises."""
        async with self.gate.hold("renew"):
            credential = self.credential
            if credential is None:
                return Outcome.SKIPPED
            self.metrics.renewals.inc()
            log.v(2, "renewing credential")
            try:
                fresh = await self._offload(self.client.renew, credential)
            except ControlPlaneError as e:
                self.metrics.renewal_failures.labels(e.kind).inc()
                if isinstance(e, Unauthorized):
                    log.warning("credential renewal refused (%s): registering again", e)
                    await self._drop_credentials(register_at_once=True)
                    return Outcome.REFUSED
                raise
            if self.credential is not credential:
                return Outcome.STALE  # a registration installed a newer credential meanwhile
            self._install(fresh)
            log.v(1, "credential renewed, valid for %.0fs", fresh.expires_in)
            await self._publish()
            return Outcome.OK

    def _register_call(self, generation: int, inventory: Inventory, count: int) -> Registration:
        # Off the event loop with the call: the token file is looked at (and read, when it changed) here.
        return self.client.register(self.token.current(), self.settings.cluster_id, generation, inventory, count,
                                    self.settings.holder)

    def _install(self, credential: Credential) -> None:
        self.credential = credential.token
        self.credential_lifetime = credential.expires_in
        self.credential_installed_at = self.clock.monotonic()
        self.renew_due_at = self.credential_installed_at + min(self.settings.renew_interval,
                                                               credential.expires_in * RENEW_AT_LIFETIME_FRACTION)
        self.renew_backoff.reset()
        self._credential_changed.set()

    # ---- loops ---------------------------------------------------------------------------------

    async def _sleep_unless(self, seconds: float, event: asyncio.Event) -> None:
        """Sleep on the injected clock, cut short when `event` is set."""
        if not event.is_set():
            await sleep_or(self.clock, seconds, event.wait())

    async def recovery_loop(self) -> None:
        while True:
            self._gpu_changed.clear()
            if not self.has_work_gpus or self.registered:
                await self._gpu_changed.wait()
                continue
            try:
                # "initial" until the first success, so the logs do not call a first start a recovery.
                outcome = await self.register("recovery" if self.registration_id else "initial")
            except ControlPlaneError as e:
                delay = self.backoff.next_delay()
                self.next_retry_in = delay
                self.metrics.backoff.set(delay)
                log.warning("registration attempt %d failed: %s; retrying in %.2fs", self.backoff.attempt, e, delay)
                await self._publish()
                await self._sleep_unless(delay, self._gpu_changed)
                continue
            if outcome is Outcome.OK:
                self.backoff.reset()
                self.metrics.backoff.set(0)

    async def periodic_loop(self) -> None:
        while True:
            await self.clock.sleep(self.settings.reregistration_interval)
            if not self.registered:
                continue
            try:
                await self.register("periodic")
            except ControlPlaneError as e:
                log.warning("periodic re-registration failed: %s; keeping current credentials", e)

    async def renewal_loop(self) -> None:
        while True:
            self._credential_changed.clear()
            if self.credential is None:
                await self._credential_changed.wait()
                continue
            now = self.clock.monotonic()
            expires_at = self.credential_expires_at
            wake_at = min(self.renew_due_at, expires_at) if now < expires_at else self.renew_due_at
            if now < wake_at:
                await self._sleep_unless(wake_at - now, self._credential_changed)
                await self._publish()  # the credential may just have expired
                continue
            try:
                await self.renew()
            except ControlPlaneError as e:
                delay = self.renew_backoff.next_delay()
                self.renew_due_at = self.clock.monotonic() + delay
                log.warning("credential renewal attempt %d failed: %s; retrying in %.2fs", self.renew_backoff.attempt, e, delay)
                await self._publish()

    async def run(self) -> None:
        await self._publish()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.recovery_loop(), name="registration-recovery")
            tg.create_task(self.periodic_loop(), name="registration-periodic")
            tg.create_task(self.renewal_loop(), name="credential-renewal")
