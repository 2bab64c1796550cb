"""A plain-HTTP control plane beyond loopback is refused at render (issue 48, part 1): the chart fails naming
`controlPlane.url` and both ways out (https://, or `controlPlane.allowInsecure=true`), and renders once that consent is
given, wiring it into the cluster agent's config (`controlPlaneAllowInsecure`) and the hooks' flags. Loopback needs no
consent; the chart's own control plane with TLS off needs it too. The chart's verdict on each URL is the agent's own
(`check_transport`, which refuses such a URL at start). No cluster: `helm template` only."""

from __future__ import annotations

import pytest
import yaml

from e2e.release import BASE, CHART, helm
from gpu_agent.foundations.config import ConfigError
from gpu_agent.foundations.control_plane_client import check_transport

EXTERNAL = ["--set", "controlPlane.enabled=false", "--set", "controlPlane.existingSecret=gpu-agent-token"]

REFUSED = ["http://cp.example.com", "http://cp.example.com:8700/", "http://10.0.0.7:8700", "http://cp.ns.svc:8700",
           "http://127.0.0.1.example.com",  # a name that begins like a loopback address
           "http://127.0.0.1:x@cp.example.com:8700",  # a user part that looks like one: the host is cp.example.com
           "http://localhost@cp.example.com", "http://127.0.0.256", "http://[::2]:8700"]
LOOPBACK = ["http://127.0.0.1:8700", "http://127.1.2.3", "http://localhost:8700", "http://LocalHost",
            "http://[::1]:8700", "http://user@127.0.0.1:8700/"]


def render(*sets: str):
    return helm("template", "t", str(CHART), "--namespace", "ns", *BASE, *EXTERNAL, *sets, check=False)


def cluster_agent_config(out: str) -> dict:
    docs = [d for d in yaml.safe_load_all(out) if d]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "t-gpu-agent-cluster-agent"]
    return yaml.safe_load(cm["data"]["config.yaml"])


def agent_accepts(url: str) -> bool:
    try:
        check_transport(url)
        return True
    except ConfigError:
        return False


def test_a_plain_http_control_plane_beyond_loopback_is_refused_naming_the_value_and_the_fix():
    r = render("--set", "controlPlane.url=http://cp.example.com")
    assert r.returncode != 0, "rendered a plain-HTTP control plane beyond loopback without controlPlane.allowInsecure"
    message = " ".join(r.stderr.split())
    assert "controlPlane.url http://cp.example.com is plain HTTP" in message, r.stderr
    assert "in clear" in message and "use https://" in message, r.stderr
    assert "set controlPlane.allowInsecure=true" in message, r.stderr


@pytest.mark.parametrize("url", REFUSED)
def test_every_non_loopback_host_is_refused_without_consent_as_the_agent_refuses_it(url):
    r = render("--set", f"controlPlane.url={url}")
    assert r.returncode != 0 and "controlPlane.allowInsecure=true" in r.stderr, (url, r.stderr)
    assert not agent_accepts(url), f"the agent accepts {url}: the chart's rule and the agent's differ"


def test_the_refusal_shows_the_url_without_its_user_part():
    r = render("--set", "controlPlane.url=http://user:hunter2@cp.example.com:8700")
    assert r.returncode != 0
    assert "controlPlane.url http://cp.example.com:8700 is plain HTTP" in r.stderr and "hunter2" not in r.stderr, r.stderr


def test_with_allow_insecure_it_renders_and_the_agent_and_hooks_are_told():
    r = render("--set", "controlPlane.url=http://cp.example.com", "--set", "controlPlane.allowInsecure=true")
    assert r.returncode == 0, r.stderr
    config = cluster_agent_config(r.stdout)
    assert config["controlPlaneUrl"] == "http://cp.example.com" and config["controlPlaneAllowInsecure"] is True, config
    assert "--control-plane-allow-insecure=true" in r.stdout  # the cleanup hook (and helm test) say so too


@pytest.mark.parametrize("url", LOOPBACK)
def test_loopback_renders_without_consent_as_the_agent_accepts_it(url):
    r = render("--set", f"controlPlane.url={url}")
    assert r.returncode == 0, (url, r.stderr)
    assert "controlPlaneAllowInsecure" not in cluster_agent_config(r.stdout)
    assert agent_accepts(url), f"the agent refuses {url}: the chart's rule and the agent's differ"


def test_https_renders_without_consent():
    r = render("--set", "controlPlane.url=https://cp.example.com")
    assert r.returncode == 0, r.stderr
    assert "controlPlaneAllowInsecure" not in cluster_agent_config(r.stdout)


def test_the_charts_own_control_plane_without_tls_is_refused_naming_both_values_until_allowed():
    own = ["--set", "controlPlane.enabled=true", "--set", "controlPlane.tls.enabled=false"]
    r = helm("template", "t", str(CHART), "--namespace", "ns", *BASE, *own, check=False)
    assert r.returncode != 0
    message = " ".join(r.stderr.split())
    assert "controlPlane.tls.enabled=false" in message and "set controlPlane.allowInsecure=true" in message, r.stderr
    r = helm("template", "t", str(CHART), "--namespace", "ns", *BASE, *own, "--set", "controlPlane.allowInsecure=true",
             check=False)
    assert r.returncode == 0, r.stderr
