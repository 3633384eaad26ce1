"""Chart defaults an SRE expects: the PrometheusRule's alerts (over metrics the code exports), CPU/memory requests
for every role, replicas spread over nodes and zones, and a `helm test` hook that really sends a chat request."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("helm_python", reason="helm-python-sdk (Helm's engine) is not installed")

from tests.common.telemetry.test_dashboard import exported_series  # noqa: E402
from tests.helm.chart import find, one, render  # noqa: E402

ALERTS = {"TandemRouterHighErrorRate", "TandemTimeToFirstTokenP99High", "TandemCircuitBreakerOpen",
          "TandemAdmissionRejecting", "TandemKVCacheUsageHigh", "TandemKVTransferFailures"}


def rules(case: str) -> dict[str, dict]:
    (rule,) = find(case, "PrometheusRule")
    return {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}


def test_prometheus_rule_is_off_by_default():
    assert not find("default", "PrometheusRule")


def test_alerts_query_only_metrics_the_code_exports():
    alerts = rules("alerts")
    assert set(alerts) == ALERTS
    exported = exported_series()
    for name, alert in alerts.items():
        used = set(re.findall(r"\btandem_[a-z0-9_]+", alert["expr"]))
        assert used and used <= exported, (name, used - exported)
        # Every selector is scoped to the release's namespace and the configured matcher, and grouped by model.
        selectors = re.findall(r"\btandem_[a-z0-9_]+(\{[^}]*\})", alert["expr"])
        assert len(selectors) == len(re.findall(r"\btandem_[a-z0-9_]+", alert["expr"])), name
        assert all('namespace="llm"' in s and 'job=~"demo-tandem-.*"' in s for s in selectors), name
        assert "model_name" in alert["expr"], name
        assert alert["labels"]["severity"] in ("warning", "critical") and alert["annotations"]["summary"]
    assert alerts["TandemTimeToFirstTokenP99High"]["expr"].rstrip().endswith("> 2.5")
    assert alerts["TandemKVCacheUsageHigh"]["for"] == "15m"
    assert find("alerts", "PrometheusRule")[0]["metadata"]["labels"]["release"] == "kube-prometheus-stack"


@pytest.mark.parametrize("case", ["default", "unified-cpu", "hostpath-cpu-minimal"])
def test_every_role_requests_cpu_and_memory_by_default(case):
    deployments = find(case, "Deployment")
    assert len(deployments) >= 2
    for deployment in deployments:
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            requests = container.get("resources", {}).get("requests", {})
            assert requests.get("cpu") and requests.get("memory"), (deployment["metadata"]["name"], container)
    router = one(case, "Deployment", "router")["spec"]["template"]["spec"]["containers"][0]
    assert router["resources"]["limits"]["memory"]  # the router's footprint is bounded; a worker's follows its model


@pytest.mark.parametrize("case", ["default", "unified-cpu"])
def test_replicas_spread_over_nodes_and_zones_by_default(case):
    for deployment in find(case, "Deployment"):
        pod = deployment["spec"]["template"]
        constraints = pod["spec"]["topologySpreadConstraints"]
        assert [c["topologyKey"] for c in constraints] == ["kubernetes.io/hostname", "topology.kubernetes.io/zone"]
        for c in constraints:
            assert c["whenUnsatisfiable"] == "ScheduleAnyway" and c["maxSkew"] == 1
            selector = c["labelSelector"]["matchLabels"]
            assert selector.items() <= pod["metadata"]["labels"].items()  # it counts this component's pods
            assert selector == deployment["spec"]["selector"]["matchLabels"]


def test_spread_keys_and_a_roles_own_constraints_are_honoured():
    for deployment in find("alerts", "Deployment"):
        constraints = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
        assert [(c["topologyKey"], c["whenUnsatisfiable"]) for c in constraints] == [
            ("topology.kubernetes.io/zone", "DoNotSchedule")]
    own = [{"maxSkew": 2, "topologyKey": "rack", "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {"app": "x"}}}]
    rendered = render({"decode": {"topologySpreadConstraints": own}})
    decode = next(text for path, text in rendered.items() if path.endswith("decode.yaml"))
    assert "topologyKey: rack" in decode and "kubernetes.io/hostname" not in decode


def hook_pod(case: str) -> dict:
    (pod,) = [p for p in find(case, "Pod") if p["metadata"]["annotations"].get("helm.sh/hook") == "test"]
    return pod


def test_helm_test_hook_targets_the_router_service_with_the_api_key():
    pod = hook_pod("init-container-model")  # the case with an API key Secret
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    service = one("init-container-model", "Service", "router")
    http = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "http")
    assert env["ROUTER_URL"]["value"] == f"http://{service['metadata']['name']}:{http}"
    assert env["API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "tandem-api-key", "key": "api-key"}
    assert pod["spec"]["restartPolicy"] == "Never"
    assert not [p for p in find("alerts", "Pod")]  # helmTest.enabled false


def run_hook(pod: dict, router_url: str) -> subprocess.CompletedProcess:
    """The hook container's command, run here against `router_url` (its Python is this repo's interpreter)."""
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env["ROUTER_URL"] = router_url
    argv = [sys.executable, *container["command"][1:], *container["args"]]
    return subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=120)


@pytest.mark.e2e
def test_helm_test_hook_passes_through_a_serving_router_and_fails_without_workers(tiny_llama):
    from tandem.common.launcher.children import free_port
    from tests.services.router.conftest import RouterProcess, readiness, start_worker, wait_until

    pod = hook_pod("default")
    port = free_port()
    worker = start_worker(tiny_llama, port)
    serving = RouterProcess("--worker", f"grpc://127.0.0.1:{port}", "--model-path", tiny_llama)
    try:
        wait_until(lambda: readiness(serving) == 200, 60, "router readiness")
        passed = run_hook(pod, serving.url)
        assert passed.returncode == 0 and passed.stdout.startswith("ok: "), passed.stderr
    finally:
        serving.stop()
        worker.stop()
    orphan = RouterProcess("--worker", f"grpc://127.0.0.1:{free_port()}", "--model-path", tiny_llama,
                           "--served-model-name", "tiny")
    try:
        failed = run_hook(pod, orphan.url)
        assert failed.returncode != 0 and "answered 503" in failed.stderr, failed.stderr
    finally:
        orphan.stop()

