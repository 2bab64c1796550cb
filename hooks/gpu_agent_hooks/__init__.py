"""Helm hooks of the gpu-agent chart, as plain Python commands (`gpu-agent-hook`).

  crds        pre-install, pre-upgrade, pre-rollback: server-side apply the chart's CRDs
              (Helm itself never upgrades CRDs; it installs crds/ on a first install only), wait
              until they are Established, then migrate stored objects to the storage version and
              trim status.storedVersions (migrate.py); a CRD that would stop serving a stored
              version is refused before anything is applied
              With --skew-check-to-version (the chart passes it unless hooks.skewCheck is false) the
              skew check runs first, in the same Job
  skew-check  refuse an upgrade or downgrade the stored objects or the running agents cannot
              survive, saying why and how to proceed (also on its own, for a GitOps sync)
  cleanup     pre-delete: deregister from the control plane, clear this release's GPUDomain
              entries, delete leftover work Pods (each one's gpu-agent.io/work-item finalizer removed
              first: the agent keeps it until the item's ack); bounded in time, never blocks an uninstall

Each check is a pure function (unit-tested); the commands only fetch and apply.

`--log-format text|json` (before or after the hook's name; the chart passes its value logFormat): text, the default,
is the plain `gpu-agent-hook: ...` lines as they always were (stdout; a failure's on stderr); json writes each line
as gpu-agent's `--log-format json` does (gpu_agent.foundations.klog's formatter: one object a line on stderr, keys ts,
level, v, logger, caller, msg, pid, thread, err). The agent's secret redactor scrubs both: the registration token
the cleanup reads never shows in a line.
"""
