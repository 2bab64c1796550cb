"""Storage-version migration of the chart's custom resources, run by the `crds` hook after it has
applied the chart's CRDs.

When a CRD's storage version changes (0.2.0: v1alpha1 -> v1beta1), objects already in etcd stay
encoded at the old version until something writes them. The hook rewrites every object once (a
read then an unchanged update: the API server stores it at the new storage version, because the
encoded bytes differ), and only when every rewrite has succeeded does it trim
`status.storedVersions` to the storage version. A later chart may then stop serving the old
version; until the trim, the skew check refuses any chart that does not serve it. Objects made or
changed after the CRD was applied are stored at the new version by the API server itself.

`ext` and `custom` are the kubernetes client's ApiextensionsV1Api and CustomObjectsApi (or fakes
with the same methods, in unit tests).
"""

from __future__ import annotations

from typing import Any

from gpu_agent.foundations.kube import REQUEST_TIMEOUT

CONFLICT_RETRIES = 5


class MigrationError(Exception):
    """A stored object could not be rewritten; storedVersions was left as it was."""


def storage_version(crd: dict[str, Any]) -> str:
    name: str = next(v["name"] for v in crd["spec"]["versions"] if v.get("storage"))
    return name


def _status(e: Exception) -> int | None:
    return getattr(e, "status", None)


def migrate(ext: Any, custom: Any, crd: dict[str, Any]) -> str:
    """Rewrites every object of `crd` at its storage version, then trims storedVersions. Returns a
    one-line report; raises MigrationError (storedVersions untouched) if any object fails."""
    name, group = crd["metadata"]["name"], crd["spec"]["group"]
    plural, storage = crd["spec"]["names"]["plural"], storage_version(crd)
    stored = list(ext.read_custom_resource_definition(name, _request_timeout=REQUEST_TIMEOUT).status.stored_versions or [])
    if stored in ([storage], []):
        return f"{name}: stored at {storage} only; nothing to migrate"
    items = custom.list_cluster_custom_object(group, storage, plural, _request_timeout=REQUEST_TIMEOUT * 6)["items"]  # every object
    rewritten = gone = 0
    for obj in items:
        namespace, obj_name = obj["metadata"].get("namespace"), obj["metadata"]["name"]
        for _ in range(CONFLICT_RETRIES):
            try:
                custom.replace_namespaced_custom_object(group, storage, namespace, plural, obj_name, obj,
                                                        _request_timeout=REQUEST_TIMEOUT)
                rewritten += 1
                break
            except Exception as e:  # noqa: BLE001 - sorted by status below
                if _status(e) == 404:
                    gone += 1
                    break
                if _status(e) != 409:
                    raise MigrationError(f"{name}: rewriting {namespace}/{obj_name} at {storage} failed: {e}; "
                                         f"storedVersions left at {stored}") from None
                try:
                    obj = custom.get_namespaced_custom_object(group, storage, namespace, plural, obj_name,
                                                             _request_timeout=REQUEST_TIMEOUT)
                except Exception as again:  # noqa: BLE001 - as above
                    if _status(again) == 404:
                        gone += 1
                        break
                    raise MigrationError(f"{name}: reading {namespace}/{obj_name} failed: {again}") from None
        else:
            raise MigrationError(f"{name}: {namespace}/{obj_name} kept changing ({CONFLICT_RETRIES} conflicts); "
                                 f"storedVersions left at {stored}: run the upgrade again")
    ext.patch_custom_resource_definition_status(name, {"status": {"storedVersions": [storage]}},
                                                _content_type="application/merge-patch+json",
                                                _request_timeout=REQUEST_TIMEOUT)
    return (f"{name}: migrated {rewritten} object(s) to {storage} ({gone} deleted meanwhile); "
            f"storedVersions {stored} -> [{storage}]")
