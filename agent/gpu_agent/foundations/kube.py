"""Kubernetes access: one place that builds API clients (in-cluster first, then kubeconfig)."""

from __future__ import annotations

from kubernetes import client, config


def api_client(kubeconfig: str = "") -> client.ApiClient:
    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()
