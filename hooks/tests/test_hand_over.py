"""Which deployed cluster agents the crds hook replaces before an upgrade (the API calls are proven
on the CI cluster by e2e/test_upgrade_matrix.py and e2e/test_releases.py; here, the decision)."""

from kubernetes import client

from gpu_agent_hooks import cli


def deployment(args, strategy="RollingUpdate"):
    return client.V1Deployment(
        metadata=client.V1ObjectMeta(name="ga-gpu-agent-cluster-agent", namespace="ns",
                                     labels={"app.kubernetes.io/version": "0.1.0"}),
        spec=client.V1DeploymentSpec(
            selector=client.V1LabelSelector(match_labels={"app": "ca"}), strategy=client.V1DeploymentStrategy(type=strategy),
            template=client.V1PodTemplateSpec(spec=client.V1PodSpec(containers=[client.V1Container(name="c", args=args)]))))


def decide(monkeypatch, dep, target):
    replaced = []
    monkeypatch.setattr(cli.client, "AppsV1Api", lambda api: type("A", (), {
        "read_namespaced_deployment": lambda self, name, ns, _request_timeout=None: dep})())
    monkeypatch.setattr(cli, "replace_non_electing", lambda api, d, version, timeout: replaced.append((d.metadata.name, version)))
    monkeypatch.setattr(cli, "delete_stale_lease", lambda api, ns, name: replaced.append(("lease", name)))
    cli.hand_over_from_non_electing(None, "ns", "ga-gpu-agent-cluster-agent", target)
    return replaced


def test_an_agent_that_does_not_elect_is_replaced_before_a_rolling_hand_over(monkeypatch):
    lease = ("lease", "ga-gpu-agent-cluster-agent")  # a Lease left by a 0.2 leader a downgrade cut off goes too
    assert decide(monkeypatch, deployment(["cluster-agent"]), "RollingUpdate") == [lease, ("ga-gpu-agent-cluster-agent", "0.1.0")]
    # ...and before a Recreate, when its own Deployment rolls (Helm's server-side apply cannot switch it).
    assert decide(monkeypatch, deployment(["cluster-agent"]), "Recreate") == [lease, ("ga-gpu-agent-cluster-agent", "0.1.0")]


def test_an_electing_agent_and_a_recreate_to_recreate_rollout_are_left_to_the_rollout(monkeypatch):
    assert decide(monkeypatch, deployment(["cluster-agent", "--leader-election=true"]), "RollingUpdate") == []
    assert decide(monkeypatch, deployment(["cluster-agent"], strategy="Recreate"), "Recreate") == [("lease", "ga-gpu-agent-cluster-agent")]


def test_elects_recognises_the_flags_of_0_2_and_the_config_file_of_later_charts():
    # 0.1.0: no election. 0.2 before the config file: every setting a flag. Since: --config, and the one flag kept for this.
    assert not cli.elects(deployment(["cluster-agent", "-v=0", "--listen-address=0.0.0.0:8080", "--executor=pod"]))
    assert cli.elects(deployment(["cluster-agent", "-v=0", "--leader-election=true", "--leader-election-lease-name=x"]))
    assert cli.elects(deployment(["cluster-agent", "--config=/etc/gpu-agent/config.yaml", "--leader-election=true"]))
    assert not cli.elects(deployment(["cluster-agent", "--config=/etc/gpu-agent/config.yaml"]))  # leaderElection.enabled=false


def test_the_crds_hook_runs_the_skew_check_first_and_a_refusal_applies_nothing(monkeypatch, tmp_path, capsys):
    """The chart runs the skew check inside the CRDs hook Job (one pod per upgrade, not two): with
    --skew-check-to-version the check comes before any CRD is applied, and a refusal stops the hook."""
    steps = []
    monkeypatch.setattr(cli, "api_client", lambda kubeconfig, limit: None)
    monkeypatch.setattr(cli, "apply_crds", lambda api, folder: steps.append("apply"))
    monkeypatch.setattr(cli, "hand_over_from_non_electing", lambda *a: steps.append("hand over"))

    def refuse(api, namespace, deployment, to_version, folder):
        steps.append(("skew", namespace, deployment, to_version))
        raise cli.SkewError("upgrade from 0.2.0 to 2.0.0 skips major version 1")

    monkeypatch.setattr(cli, "skew_check", refuse)
    args = ["crds", f"--dir={tmp_path}", "--namespace=ns", "--cluster-agent=ga-gpu-agent-cluster-agent"]
    assert cli.main([*args, "--skew-check-to-version=2.0.0"]) == 1
    assert steps == [("skew", "ns", "ga-gpu-agent-cluster-agent", "2.0.0")]
    assert "refused: upgrade from 0.2.0 to 2.0.0 skips major version 1" in capsys.readouterr().err
    steps.clear()
    assert cli.main(args) == 0  # hooks.skewCheck=false: no check
    assert steps == ["apply", "hand over"]
